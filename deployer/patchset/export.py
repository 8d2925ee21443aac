"""Overlay -> released patch set: one commit per concern on a clone of the pristine base, each
turned into a git-format patch, plus `series` and `manifest.yaml`.

Determinism: commits use FIXED_IDENTITY (fixed author, committer and dates), git runs without the
user's global config, and format-patch writes full blob ids, a zero `From` line and no signature,
so the same overlay gives the same bytes. The manifest's `created` date is the only input that is
not the overlay: `--date`, else $SOURCE_DATE_EPOCH, else today (UTC).
A released version is immutable: the set is written to a temporary directory beside the target
and renamed into place only when complete and verified by the loader.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from .sglang_base import Base, clone_base, ensure_base
from .overlay import HUNKS_DIR, Concern, Overlay, assign_files, load_overlay
from ..errors import PatchSetError, UsageError
from .local_git import FIXED_IDENTITY, git, git_out
from .path_safety import patch_paths
from .compare import compare_patch
from .release import VERSION_RE, list_versions, load_patch_set, next_version, sha256_bytes

# No user/system git config may change commits or format-patch output.
EXPORT_ENV = {**FIXED_IDENTITY, "GIT_CONFIG_GLOBAL": os.devnull}
FORMAT_PATCH_ARGS = (
    "format-patch",
    "--no-numbered",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-renames",
    "--no-color",
    "--diff-algorithm=myers",
    "--stat=80",
    "--subject-prefix=PATCH",
    "--no-thread",
    "--no-attach",
    "--no-cover-letter",
)


@dataclass(frozen=True)
class BuiltPatch:
    name: str
    concern: str
    data: bytes
    files: tuple[str, ...]


@dataclass(frozen=True)
class ExportResult:
    path: Path
    version: str
    patches: tuple[BuiltPatch, ...]
    skipped: tuple[str, ...]  # concern ids with nothing to export


def created_date(date: str | None = None) -> str:
    """`--date`, else $SOURCE_DATE_EPOCH, else today; always YYYY-MM-DD in UTC."""
    if date:
        try:
            return dt.date.fromisoformat(date).isoformat()
        except ValueError:
            raise UsageError(f"--date {date!r} is not a date (YYYY-MM-DD)") from None
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        try:
            return dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc).date().isoformat()
        except ValueError:
            raise UsageError(f"SOURCE_DATE_EPOCH={epoch!r} is not an integer") from None
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def patch_name(index: int, set_name: str, concern: Concern) -> str:
    return f"{index:04d}-{set_name}-{concern.id}.patch"


def commit_message(concern: Concern) -> str:
    return f"{concern.title}\n\n{concern.description}\n\nConcern: {concern.id}\n"


def check_hunk_files(overlay: Overlay) -> None:
    """Every file under hunks/ belongs to exactly one concern, and every listed hunk exists."""
    listed = [h for c in overlay.concerns for h in c.hunks]
    for h in listed:
        if not (overlay.path / h).is_file():
            raise PatchSetError(f"hunk file {h} listed in {overlay.path / 'concerns.yaml'} does not exist")
        if listed.count(h) > 1:
            raise PatchSetError(f"hunk file {h} is listed by more than one concern")
    hunks_dir = overlay.path / HUNKS_DIR
    present = (
        sorted(p.relative_to(overlay.path).as_posix() for p in hunks_dir.rglob("*") if p.is_file())
        if hunks_dir.is_dir()
        else []
    )
    for h in present:
        if h not in listed:
            raise PatchSetError(f"hunk file {h} is listed by no concern in {overlay.path / 'concerns.yaml'}")


def refuse_shadowing(files: list[str], work: Path) -> None:
    """New files must be new: one that SGLang already has is changed with a hunk instead."""
    shadowed = git_out(work, "ls-files", "--", *files, env=EXPORT_ENV).splitlines() if files else []
    if shadowed:
        raise PatchSetError(
            f"overlay file {shadowed[0]} already exists in SGLang; change it with a hunk "
            f"under {HUNKS_DIR}/ instead of a full copy"
        )


def copy_new_files(overlay: Overlay, files: list[str], work: Path) -> None:
    """New files (refuse_shadowing checked them) are kept whole (only the executable bit of the
    mode is carried over) and staged.

    The scratch clone has no checkout: only these files are written, everything else stays in
    the index."""
    if not files:
        return
    for rel in files:
        src, dst = overlay.path / rel, work / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
        dst.chmod(0o755 if os.access(src, os.X_OK) else 0o644)
    git(work, "add", "-f", "--", *files, env=EXPORT_ENV)


def apply_hunks(overlay: Overlay, concern: Concern, work: Path) -> None:
    """Apply the concern's hunk files strictly (exact context, no fuzz) to the index."""
    for rel in concern.hunks:
        data = (overlay.path / rel).read_bytes()
        patch_paths(data, patch=rel)  # refuse unsafe paths before git sees them
        proc = git(work, "apply", "--cached", "--whitespace=nowarn", "-", input=data, check=False, env=EXPORT_ENV)
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise PatchSetError(
                f"hunk file {rel} (concern {concern.id}) does not apply to the pristine "
                f"base: {err[0] if err else 'git apply failed'}; refresh it against the base"
            )


def commit_concern(overlay: Overlay, concern: Concern, files: list[str], work: Path) -> bool:
    """Stage and commit one concern; False when it has nothing to commit."""
    copy_new_files(overlay, files, work)
    apply_hunks(overlay, concern, work)
    # A new file always changes the index; only hunks alone can leave it as it was.
    if not files and git(work, "diff", "--cached", "--quiet", check=False, env=EXPORT_ENV).returncode == 0:
        return False
    git(
        work,
        "commit",
        "-q",
        "--no-verify",
        "--allow-empty-message",
        "-F",
        "-",
        input=commit_message(concern).encode(),
        env=EXPORT_ENV,
    )
    return True


def format_patches(work: Path, base_commit: str, out: Path) -> list[bytes]:
    """git format-patch every commit after base_commit; the patches' bytes, in order."""
    out.mkdir()
    git(work, *FORMAT_PATCH_ARGS, "-o", str(out), f"{base_commit}..HEAD", env=EXPORT_ENV)
    return [p.read_bytes() for p in sorted(out.glob("*.patch"))]


def build_patches(overlay: Overlay, base: Base, scratch: Path) -> tuple[list[BuiltPatch], list[str]]:
    """Commit each concern on a fresh clone of the base; return the patches and the skipped ids."""
    owned = assign_files(overlay)
    check_hunk_files(overlay)
    work = clone_base(scratch / "work", base.version, source=base.path, checkout=False)
    refuse_shadowing([f for c in overlay.concerns for f in owned[c.id]], work)
    committed, skipped = [], []
    for index, concern in enumerate(overlay.concerns, start=1):
        if commit_concern(overlay, concern, owned[concern.id], work):
            committed.append((index, concern))
        else:
            skipped.append(concern.id)
    datas = format_patches(work, base.commit, scratch / "out")
    built = []
    for (index, concern), data in zip(committed, datas, strict=True):
        # Numbered by the concern's place, so a patch keeps its name as earlier concerns fill in.
        name = patch_name(index, overlay.name, concern)
        built.append(BuiltPatch(name, concern.id, data, tuple(patch_paths(data, patch=name))))
    return built, skipped


def manifest(
    overlay: Overlay, version: str, created: str, base: Base, patches: list[BuiltPatch], skipped: list[str]
) -> dict:
    doc: dict = {
        "name": overlay.name,
        "version": version,
        "created": created,
        "base": {"sglang": base.version, "tree": base.tree},
        "patches": [
            {"name": p.name, "concern": p.concern, "sha256": sha256_bytes(p.data), "files": list(p.files)}
            for p in patches
        ],
    }
    if skipped:
        doc["skipped"] = [{"concern": c, "reason": "no files or hunks in the overlay"} for c in skipped]
    return doc


def write_set(dest: Path, doc: dict, patches: list[BuiltPatch]) -> None:
    for p in patches:
        (dest / p.name).write_bytes(p.data)
    (dest / "series").write_text("".join(f"{p.name}\n" for p in patches))
    (dest / "manifest.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000))


def render_set(overlay_path: Path, dest: Path, *, version: str, created: str, base: Base | None = None) -> ExportResult:
    """Write the set for overlay_path into the (new, empty) directory dest."""
    overlay = load_overlay(overlay_path)
    base = base or ensure_base()
    with tempfile.TemporaryDirectory(prefix="ddeploy-export-") as tmp:
        patches, skipped = build_patches(overlay, base, Path(tmp))
    if not patches:
        raise PatchSetError(f"overlay {overlay_path} has nothing to export (no files, no hunks)")
    write_set(dest, manifest(overlay, version, created, base, patches, skipped), patches)
    return ExportResult(dest, version, tuple(patches), tuple(skipped))


def export_patch_set(
    overlay_path: Path, root: Path, *, version: str | None = None, date: str | None = None, base: Base | None = None
) -> ExportResult:
    """Release the overlay as `root/<version>/` (default: the next patch version); never overwrites."""
    created = created_date(date)
    version = version or next_version(list_versions(root=root))
    if not VERSION_RE.match(version):
        raise UsageError(f"version {version!r} must look like MAJOR.MINOR.PATCH")
    final = root / version
    if final.exists():
        raise PatchSetError(
            f"patch set {version} is already released at {final}; released sets are "
            f"immutable, export a new version (next: {next_version(list_versions(root=root))})"
        )
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".export-{version}-", dir=root))
    try:
        result = render_set(overlay_path, tmp, version=version, created=created, base=base)
        load_patch_set(tmp)  # the same checks every consumer runs: checksums, series, path safety
        if final.exists():
            raise PatchSetError(f"patch set {version} appeared at {final} while exporting; not replacing it")
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(final, version, result.patches, result.skipped)


def sync_differences(overlay_path: Path, released: Path, *, base: Base | None = None) -> list[str]:
    """Re-export the overlay as the released set's version/date and list every byte difference.

    Empty when `released` is exactly what `ddeploy patches export` would write today."""
    old = load_patch_set(released)
    with tempfile.TemporaryDirectory(prefix="ddeploy-sync-") as tmp:
        fresh_dir = Path(tmp) / old.version
        fresh_dir.mkdir()
        render_set(overlay_path, fresh_dir, version=old.version, created=old.created, base=base)
        fresh = load_patch_set(fresh_dir)
        names = sorted({p.name for p in old.patches} | {p.name for p in fresh.patches})
        problems = []
        for name in names:
            a = next((p for p in old.patches if p.name == name), None)
            b = next((p for p in fresh.patches if p.name == name), None)
            if a is None or b is None:
                problems.append(
                    f"{name}: {'missing from the released set' if a is None else 'no longer produced by the overlay'}"
                )
            elif a.sha256 != b.sha256:
                problems.append(compare_patch(a, b).summary().replace(": changed", ": differs", 1))
        for meta in ("series", "manifest.yaml"):
            if not problems and (released / meta).read_bytes() != (fresh_dir / meta).read_bytes():
                problems.append(f"{meta}: differs")
    return problems
