"""The release window: which released sets the tree holds, and the rest recoverable from git.

The tree keeps the newest WINDOW releases plus every version a shipped host file pins (hosts/*.yaml
and the `ddeploy init` example). Each older release is recorded in patches/<name>/archive.yaml
(version, the commit that added it, its tag `<name>-<version>`, its manifest's sha256) and removed
from the tree; `ddeploy patches restore V` brings it back from the tag, else from the recorded
commit (a clone without tags), into the cache, verified like every release.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import yaml

from ..documents import ArchiveDoc, ArchivedRelease, load_document
from ..errors import PatchSetError
from ..locations import HOSTS_DIR, PATCH_SET_NAME, cache_dir
from .local_git import git, git_out
from .release import list_versions, load_patch_set, sets_root, sha256_bytes, version_key

WINDOW = 3  # the newest releases the tree keeps: the one hosts get, and two to step back to
ARCHIVE_FILE = "archive.yaml"
HEADER = (
    '# Releases outside the window (docs/patches.md, "The release window"): removed from the tree,\n'
    "# kept in git. `ddeploy patches restore VERSION` brings one back from its tag, else its commit.\n"
)


@dataclass(frozen=True)
class WindowChange:
    archived: list[str]
    returned: list[str]  # pinned releases brought back into the tree
    tagged: list[str]


def tag_name(version: str, name: str = PATCH_SET_NAME) -> str:
    return f"{name}-{version}"


def restore_hint(version: str) -> str:
    return f"`ddeploy patches restore {version}`"


def read_archive(root: Path) -> dict[str, ArchivedRelease]:
    """{version: record} of the releases archived from `root` (none without an archive.yaml)."""
    path = root / ARCHIVE_FILE
    if not path.is_file():
        return {}
    doc = load_document(path, ArchiveDoc, PatchSetError, "release archive")
    return {r.version: r for r in doc.archived}


def window(versions: Iterable[str], pins: Iterable[str] = (), keep: int = WINDOW) -> list[str]:
    """The releases the tree should hold: the newest `keep`, plus every pinned one that exists."""
    ordered = sorted(set(versions), key=version_key)
    kept = set(ordered[max(len(ordered) - keep, 0) :]) | (set(pins) & set(ordered))
    return [v for v in ordered if v in kept]


def shipped_pins(hosts_dir: Path = HOSTS_DIR) -> dict[str, list[str]]:
    """{version: [where]} for every release a shipped host file or the `ddeploy init` example pins."""
    from ..inventory import load_file, parse_host
    from ..inventory_example import EXAMPLE

    hosts = [parse_host(yaml.safe_load(EXAMPLE), "the `ddeploy init` example")]
    if hosts_dir.is_dir():
        from ..locations import inventory_files

        hosts += [h for f in inventory_files(hosts_dir) for h in load_file(f)]
    pins: dict[str, list[str]] = {}
    for h in hosts:
        if h.version:
            pins.setdefault(h.version, []).append(h.source)
    return pins


# --- where an archived release is usable ------------------------------------------------------


def restored_dir(version: str, name: str = PATCH_SET_NAME) -> Path:
    """Where `patches restore` puts an archived release: the cache, so the tree stays the window."""
    return cache_dir() / "releases" / name / version


def _holds(record: ArchivedRelease, path: Path) -> bool:
    manifest = path / "manifest.yaml"
    return manifest.is_file() and sha256_bytes(manifest.read_bytes()) == record.manifest_sha256


def restored_copy(record: ArchivedRelease, name: str = PATCH_SET_NAME) -> Path | None:
    """The restored copy of an archived release when it holds the recorded manifest, else None."""
    path = restored_dir(record.version, name)
    return path if _holds(record, path) else None


def archived_dir(root: Path, version: str, name: str = PATCH_SET_NAME) -> Path | None:
    """The restored copy of an archived release; None when `version` is not archived; an error
    naming the restore command when it is archived and not restored (or restored differently)."""
    record = read_archive(root).get(version)
    if record is None:
        return None
    path = restored_copy(record, name)
    if path is not None:
        return path
    raise PatchSetError(
        f"patch set {name} {version} is archived (outside the release window, git tag {record.tag}); "
        f"bring it back with {restore_hint(version)}"
    )


# --- git: the checkout holding the sets, a release's commit and files --------------------------


def _checkout(root: Path, command: str) -> tuple[Path, str]:
    """(the git top level holding `root`, root's path inside it with a trailing '/')."""
    proc = git(root, "rev-parse", "--show-toplevel", "--show-prefix", check=False) if root.is_dir() else None
    if proc is None or proc.returncode != 0:
        raise PatchSetError(
            f"cannot {command}: {root} is not in a git checkout (an installed ddeploy has no history); "
            f"run `ddeploy patches {command}` in a git clone of the ddeploy repository, or set "
            f"DDEPLOY_PATCHES_DIR to such a clone's patches/"
        )
    top, _, prefix = proc.stdout.decode().partition("\n")
    return Path(top), prefix.strip()


def _has_commit(repo: Path, commit: str) -> bool:
    return git(repo, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode == 0


def _release_ref(repo: Path, record: ArchivedRelease) -> tuple[str, str]:
    """(commit, where it came from): the release's tag, else the commit archive.yaml records."""
    tagged = git(repo, "rev-parse", "-q", "--verify", f"refs/tags/{record.tag}^{{commit}}", check=False)
    if tagged.returncode == 0:
        return tagged.stdout.decode().strip(), f"tag {record.tag}"
    if _has_commit(repo, record.commit):
        return record.commit, f"commit {record.commit[:12]} (archive.yaml; no tag {record.tag} here)"
    missing = f"neither tag {record.tag} nor commit {record.commit[:12]} is in {repo}"
    if git_out(repo, "rev-parse", "--is-shallow-repository") == "true":
        raise PatchSetError(
            f"cannot restore {record.version}: {missing} (a shallow clone); "
            f"run `git fetch --unshallow --tags`, then restore again"
        )
    raise PatchSetError(
        f"cannot restore {record.version}: {missing}; fetch the history (`git fetch --tags origin`), then restore again"
    )


def _release_files(repo: Path, ref: str, directory: str) -> dict[str, bytes]:
    """{file name: bytes} of the release directory at `ref`; a release is a flat directory of files."""
    listing = git_out(repo, "ls-tree", "-z", "--full-tree", ref, "--", f"{directory}/")
    files: dict[str, bytes] = {}
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind != "blob" or mode not in ("100644", "100755") or path.count("/") != directory.count("/") + 1:
            raise PatchSetError(f"{ref[:12]}:{path} is not a plain file; refusing to restore it")
        files[path.rsplit("/", 1)[1]] = git(repo, "cat-file", "blob", blob).stdout
    if not files:
        raise PatchSetError(f"commit {ref[:12]} has no {directory}/; the archive record is wrong")
    return files


def _write_verified(files: dict[str, bytes], dest: Path, record: ArchivedRelease) -> None:
    """Write beside dest, check the manifest's sha256 and load the set (every patch's checksum,
    series, path safety), then rename into place: a failed restore leaves nothing."""
    tmp = dest.parent / f".{dest.name}.restore-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for file_name, data in files.items():
            (tmp / file_name).write_bytes(data)
        if not _holds(record, tmp):
            raise PatchSetError(
                f"the restored manifest of {record.version} does not match archive.yaml's sha256 "
                f"{record.manifest_sha256[:12]}…; refusing it"
            )
        restored = load_patch_set(tmp)
        if restored.version != record.version:
            raise PatchSetError(f"the restored set says version {restored.version}, not {record.version}")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fetch(root: Path, record: ArchivedRelease, dest: Path) -> str:
    repo, prefix = _checkout(root, f"restore {record.version}")
    ref, source = _release_ref(repo, record)
    _write_verified(_release_files(repo, ref, prefix + record.version), dest, record)
    return source


# --- the commands --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    version: str
    path: Path
    source: str | None  # None: it was already there


def restore_release(version: str, root: Path | None = None, name: str = PATCH_SET_NAME) -> Restored:
    """Bring an archived release back into the cache (restored_dir), verified."""
    root = root or sets_root(name)
    if (root / version).is_dir():
        return Restored(version, root / version, None)
    archive = read_archive(root)
    record = archive.get(version)
    if record is None:
        known = ", ".join(sorted({*list_versions(name, root), *archive}, key=version_key)) or "none"
        raise PatchSetError(f"unknown {name} release {version} under {root} (released: {known})")
    dest = restored_dir(version, name)
    if _holds(record, dest):
        load_patch_set(dest)
        return Restored(version, dest, None)
    return Restored(version, dest, _fetch(root, record, dest))


def _added_in(repo: Path, directory: str) -> str:
    """The commit that added a release directory as it stands (its manifest, byte for byte),
    refusing one not committed as is. The first such add: an export withdrawn before it left the
    machine and released again was added twice, and only the second add holds the released
    files; a release brought back later is added again with the same files, and the first add
    is the release."""
    manifest = f"{directory}/manifest.yaml"
    commits = git_out(repo, "log", "--diff-filter=A", "--format=%H", "--", manifest).split()
    if not commits:
        raise PatchSetError(f"{directory} is not committed yet; commit it, then apply the window")
    if git_out(repo, "status", "--porcelain", "--", f"{directory}/"):
        raise PatchSetError(f"{directory} has uncommitted changes; released sets are immutable")
    current = (repo / manifest).read_bytes()
    for commit in reversed(commits):  # oldest first
        if git(repo, "show", f"{commit}:{manifest}").stdout == current:
            return commit
    raise PatchSetError(f"{manifest} differs from every commit that added it; released sets are immutable")


def _tag(repo: Path, tag: str, commit: str) -> bool:
    """Create the lightweight tag at commit (True), or check the existing one points there (False)."""
    found = git(repo, "rev-parse", "-q", "--verify", f"refs/tags/{tag}^{{commit}}", check=False)
    if found.returncode != 0:
        git(repo, "tag", tag, commit)
        return True
    if found.stdout.decode().strip() != commit:
        raise PatchSetError(f"tag {tag} points at {found.stdout.decode()[:12]}, not the release's commit {commit[:12]}")
    return False


def _record(root: Path, version: str, tag: str, commit: str) -> ArchivedRelease:
    manifest = load_patch_set(root / version)
    data = (root / version / "manifest.yaml").read_bytes()
    return ArchivedRelease(
        version=version, created=manifest.created, tag=tag, commit=commit, manifest_sha256=sha256_bytes(data)
    )


def write_archive(root: Path, records: Iterable[ArchivedRelease]) -> None:
    ordered = sorted(records, key=lambda r: version_key(r.version))
    doc = {"archived": [r.model_dump() for r in ordered]}
    (root / ARCHIVE_FILE).write_text(HEADER + yaml.safe_dump(doc, sort_keys=False))


def apply_window(root: Path | None = None, pins: Iterable[str] | None = None, keep: int = WINDOW) -> WindowChange:
    """Tag every committed release, archive those outside the window (record, remove from the
    tree) and bring archived ones the window now holds (a new pin) back into the tree."""
    root = root or sets_root()
    pins = list(shipped_pins()) if pins is None else list(pins)
    archive, in_tree = read_archive(root), list_versions(root=root)
    kept = set(window([*in_tree, *archive], pins, keep))
    repo, prefix = _checkout(root, "archive")
    tagged, archived = [], []
    for version in in_tree:
        commit = _added_in(repo, prefix + version)
        if _tag(repo, tag_name(version), commit):
            tagged.append(version)
        if version not in kept:
            archive[version] = _record(root, version, tag_name(version), commit)
            archived.append(version)
    for record in archive.values():  # a clone without tags gets them back from archive.yaml
        known = record.version not in archived and _has_commit(repo, record.commit)
        if known and _tag(repo, record.tag, record.commit):
            tagged.append(record.version)
    returned = [v for v in sorted(archive, key=version_key) if v in kept]
    for version in returned:
        _fetch(root, archive.pop(version), root / version)
    for version in archived:
        shutil.rmtree(root / version)
    write_archive(root, archive.values())
    return WindowChange(archived, returned, tagged)
