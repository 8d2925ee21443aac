"""What changed between two released patch sets, per patch (matched by concern).

A patch is `added`, `removed`, `changed` or `unchanged`; for a changed one we name the files
whose diff changed (added / removed / changed within the patch) and can show a unified diff of
the two patch texts.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .release import Patch, PatchSet

ADDED, REMOVED, CHANGED, UNCHANGED = "added", "removed", "changed", "unchanged"


@dataclass(frozen=True)
class PatchChange:
    concern: str
    old: Patch | None
    new: Patch | None
    status: str
    files_added: tuple[str, ...] = ()
    files_removed: tuple[str, ...] = ()
    files_changed: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return (self.new or self.old).name  # type: ignore[union-attr]

    def summary(self) -> str:
        parts = (
            [f"+{f}" for f in self.files_added]
            + [f"-{f}" for f in self.files_removed]
            + [f"~{f}" for f in self.files_changed]
        )
        if self.status == CHANGED and not parts:
            parts = ["message only"]
        return f"{self.name}: {self.status}" + (f" ({', '.join(parts)})" if parts else "")

    def unified(self, old_label: str, new_label: str) -> str:
        """A unified diff of the two patch texts (empty when unchanged)."""
        old = (self.old.data if self.old else b"").decode(errors="replace").splitlines(keepends=True)
        new = (self.new.data if self.new else b"").decode(errors="replace").splitlines(keepends=True)
        return "".join(difflib.unified_diff(old, new, f"{old_label}/{self.name}", f"{new_label}/{self.name}"))


def file_sections(data: bytes) -> dict[str, bytes]:
    """Split a patch into its per-file diffs, keyed by the `diff --git` line (commit header dropped)."""
    sections: dict[str, bytes] = {}
    key, buf = None, []
    for line in data.split(b"\n"):
        if line.startswith(b"diff --git "):
            if key is not None:
                sections[key] = b"\n".join(buf)
            key, buf = line.decode(errors="replace"), []
        elif key is not None:
            buf.append(line)
    if key is not None:
        sections[key] = b"\n".join(buf)
    return sections


def _path_of(header: str) -> str:
    rest = header[len("diff --git ") :]
    return rest.split(" b/", 1)[0][2:] if rest.startswith("a/") else rest


def compare_patch(old: Patch, new: Patch) -> PatchChange:
    if old.sha256 == new.sha256:
        return PatchChange(new.concern, old, new, UNCHANGED)
    a, b = file_sections(old.data), file_sections(new.data)
    added = tuple(_path_of(k) for k in b if k not in a)
    removed = tuple(_path_of(k) for k in a if k not in b)
    changed = tuple(_path_of(k) for k in b if k in a and a[k] != b[k])
    return PatchChange(new.concern, old, new, CHANGED, added, removed, changed)


def diff_sets(old: PatchSet, new: PatchSet) -> list[PatchChange]:
    """One PatchChange per concern present in either set, in the new set's order, then removed ones."""
    old_by = {p.concern or p.name: p for p in old.patches}
    new_by = {p.concern or p.name: p for p in new.patches}
    changes = []
    for key, patch in new_by.items():
        if key in old_by:
            changes.append(compare_patch(old_by[key], patch))
        else:
            changes.append(PatchChange(key, None, patch, ADDED, files_added=patch.files))
    for key, patch in old_by.items():
        if key not in new_by:
            changes.append(PatchChange(key, patch, None, REMOVED, files_removed=patch.files))
    return changes
