"""The overlay's concerns (`overlays/<name>/concerns.yaml`): which overlay files and hunk files
make up each patch of a released set, in order.

concerns.yaml:
    name: ddtree
    ignore: ["**/__pycache__/**", "**/*.pyc"]     # never exported
    concerns:
      - id: builder                                 # patch 0001-ddtree-builder.patch
        title: "DDTree: best-first draft-tree builder"   # the patch subject
        description: |                               # the patch body: what it is for
          ...
        files: ["python/sglang/srt/speculative/ddtree_tree*.py"]   # globs, relative to the overlay
        hunks: ["hunks/builder.patch"]                # small diffs into upstream SGLang files

Globs: `*` and `?` stay inside one path component, `**/` spans any number of directories.
Every overlay file (other than concerns.yaml, hunks/ and ignored files) must match exactly one
concern, so a new file can never be silently left out of a release.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from ..documents import ConcernsDoc, load_document
from ..errors import PatchSetError
from .path_safety import check_path

CONCERNS_FILE = "concerns.yaml"
HUNKS_DIR = "hunks"
DEFAULT_IGNORE = ("**/__pycache__/**", "**/*.pyc", "**/.pytest_cache/**", "**/.DS_Store")


@dataclass(frozen=True)
class Concern:
    id: str
    title: str
    description: str
    files: tuple[str, ...]  # globs relative to the overlay
    hunks: tuple[str, ...]  # hunk files relative to the overlay


@dataclass(frozen=True)
class Overlay:
    name: str
    path: Path
    concerns: tuple[Concern, ...]
    ignore: tuple[str, ...]


@functools.cache  # a few dozen patterns, matched against every overlay file
def glob_regex(pattern: str) -> re.Pattern[str]:
    """Translate a path glob (`*`, `?`, `[...]`, `**/`) into a regex over POSIX relative paths."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append(r"(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2 :]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append("[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def matches(pattern: str, path: str) -> bool:
    return glob_regex(pattern).match(path) is not None


def load_overlay(path: Path) -> Overlay:
    """Read and check `<overlay>/concerns.yaml` (deployer.documents.ConcernsDoc)."""
    cfile = path / CONCERNS_FILE
    doc = load_document(cfile, ConcernsDoc, PatchSetError, "file; the overlay needs its list of concerns")
    ids = [c.id for c in doc.concerns]
    dup = sorted({c for c in ids if ids.count(c) > 1})
    if dup:
        raise PatchSetError(f"{cfile}: concerns: ids must be unique, repeated: {', '.join(dup)}")
    concerns = tuple(Concern(c.id, c.title, c.description, tuple(c.files), tuple(c.hunks)) for c in doc.concerns)
    return Overlay(doc.name or path.name, path, concerns, DEFAULT_IGNORE + tuple(doc.ignore))


def overlay_files(overlay: Overlay) -> list[str]:
    """The overlay's new files (sorted, relative), without concerns.yaml, hunks/ and ignored files."""
    found = []
    for p in sorted(overlay.path.rglob("*")):
        rel = p.relative_to(overlay.path).as_posix()
        if rel == CONCERNS_FILE or rel == HUNKS_DIR or rel.startswith(HUNKS_DIR + "/"):
            continue
        if any(matches(g, rel) for g in overlay.ignore):
            continue
        if p.is_symlink():
            raise PatchSetError(f"overlay file {rel} is a symlink; the overlay must hold real files")
        if p.is_file():
            check_path(rel, patch=f"overlay {overlay.name}", strip_prefix=False)
            found.append(rel)
    return found


def assign_files(overlay: Overlay) -> dict[str, list[str]]:
    """concern id -> its overlay files; a file matching no concern, or two, is an error naming it."""
    owned: dict[str, list[str]] = {c.id: [] for c in overlay.concerns}
    for rel in overlay_files(overlay):
        owners = [c.id for c in overlay.concerns if any(matches(g, rel) for g in c.files)]
        if not owners:
            raise PatchSetError(
                f"overlay file {rel} matches no concern in {overlay.path / CONCERNS_FILE}; "
                f"add a glob for it to one concern"
            )
        if len(owners) > 1:
            raise PatchSetError(
                f"overlay file {rel} matches concerns {' and '.join(owners)} in "
                f"{overlay.path / CONCERNS_FILE}; make the globs disjoint"
            )
        owned[owners[0]].append(rel)
    return owned
