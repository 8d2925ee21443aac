"""A released patch set: `patches/<name>/<version>/` with `series`, the patches and
`manifest.yaml`. Loading verifies everything (series vs manifest, sha256, path safety), so
nothing downstream ever sees an unverified patch.

manifest.yaml:
    name: ddtree
    version: 0.1.0
    created: '2026-11-29'
    base: {sglang: 0.5.23, tree: <git tree hash of the pristine base>}
    patches:
      - {name: 0001-ddtree-builder.patch, concern: builder, sha256: <hex>, files: [python/...]}
    skipped: [{concern: sampling, reason: ...}]    # optional: concerns with nothing to export

Released sets live under $DDEPLOY_PATCHES_DIR/<name> when set, else the project's patches/<name>;
releases outside the window are archived (archive.py) and found in the cache once restored.
The `files` of a Patch are always re-derived from the verified patch bytes, never trusted from
the manifest.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..documents import ManifestDoc, load_document
from ..errors import ChecksumError, PatchSetError
from .path_safety import patch_paths, patch_preimages
from ..locations import PATCH_SET_NAME, patch_set_root

VERSION_RE = re.compile(r"^\d+\.\d+\.\d+\Z")
DEV_TAG = "+dev."  # a dev snapshot's version: <newest release>+dev.<content hash> (snapshot.py)


@dataclass(frozen=True)
class Patch:
    name: str
    concern: str
    sha256: str
    files: tuple[str, ...]
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class PatchSet:
    name: str
    version: str
    created: str
    base_version: str
    base_tree: str
    patches: tuple[Patch, ...]
    path: Path

    @property
    def ident(self) -> str:
        return f"{self.name}/{self.version}"

    @property
    def dev(self) -> bool:
        """A dev snapshot of the overlay's working copy, not a release."""
        return DEV_TAG in self.version

    @property
    def files(self) -> list[str]:
        """All files the set touches, in order of first appearance."""
        return list(dict.fromkeys(f for p in self.patches for f in p.files))

    def preimages(self) -> dict[str, str | None]:
        """What the checkout must hold for the series to apply exactly: {path: the blob the first
        patch touching it expects (from its full-index line), or None where the set creates it}."""
        out: dict[str, str | None] = {}
        for p in self.patches:
            for path, blob in patch_preimages(p.data, patch=p.name).items():
                out.setdefault(path, blob)
        return out

    def fingerprint(self) -> str:
        """One hash over the ordered patch hashes: equal sets have equal fingerprints."""
        h = hashlib.sha256()
        for p in self.patches:
            h.update(f"{p.name}\0{p.sha256}\n".encode())
        return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def sets_root(name: str = PATCH_SET_NAME) -> Path:
    """Where released sets of `name` live: $DDEPLOY_PATCHES_DIR/<name>, else the project's patches/<name>."""
    explicit = os.environ.get("DDEPLOY_PATCHES_DIR")
    return Path(explicit) / name if explicit else patch_set_root(name)


def next_version(versions: list[str]) -> str:
    """The next patch version after the newest released one; 0.1.0 for the first release."""
    if not versions:
        return "0.1.0"
    major, minor, patch = version_key(max(versions, key=version_key))
    return f"{major}.{minor}.{patch + 1}"


def list_versions(name: str = PATCH_SET_NAME, root: Path | None = None) -> list[str]:
    root = root or sets_root(name)
    if not root.is_dir():
        return []
    found = [d.name for d in root.iterdir() if d.is_dir() and VERSION_RE.match(d.name)]
    return sorted(found, key=version_key)


def resolve_dir(spec: str | Path | None, name: str = PATCH_SET_NAME, root: Path | None = None) -> Path:
    """A version ("0.1.0"), "latest"/None, or a directory path -> the patch set directory."""
    root = root or sets_root(name)
    if spec is None or str(spec) == "latest":
        versions = list_versions(name, root)
        if not versions:
            raise PatchSetError(f"no released {name} patch set under {root}; run `ddeploy patches export`")
        return root / versions[-1]
    spec_s = str(spec)
    if VERSION_RE.match(spec_s):
        path = root / spec_s
        if path.is_dir():
            return path
        from .archive import archived_dir  # archive.py builds on this module

        restored = archived_dir(root, spec_s, name)
        if restored is None:
            known = ", ".join(list_versions(name, root)) or "none"
            raise PatchSetError(f"patch set {name} {spec_s} not found under {root} (released: {known})")
        return restored
    path = Path(spec_s)
    if not path.is_dir():
        raise PatchSetError(f"patch set {spec_s!r} is neither a released version nor a directory")
    return path


def _reason(exc: Exception) -> str:
    return "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else (exc.strerror or str(exc))


def _read_manifest(path: Path) -> ManifestDoc:
    return load_document(path / "manifest.yaml", ManifestDoc, PatchSetError, "manifest")


def _read_series(path: Path) -> list[str]:
    series = path / "series"
    if not series.is_file():
        raise PatchSetError(f"{series}: missing series file")
    try:
        text = series.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PatchSetError(f"{series}: cannot read the series file ({_reason(exc)})") from None
    names = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    return [n for n in names if n]


def load_patch_set(spec: str | Path | None = None, name: str = PATCH_SET_NAME, root: Path | None = None) -> PatchSet:
    """Load and fully verify a patch set (checksums, series/manifest agreement, path safety)."""
    path = resolve_dir(spec, name, root)
    manifest = _read_manifest(path)
    series = _read_series(path)
    listed = [e.name for e in manifest.patches]
    if listed != series:
        raise PatchSetError(f"{path}: series {series} does not match manifest patches {listed}")
    patches = []
    for entry in manifest.patches:
        file = path / entry.name
        if not file.is_file():
            raise PatchSetError(f"{path}: patch {entry.name} listed in series is missing")
        data = file.read_bytes()
        actual = sha256_bytes(data)
        if actual != entry.sha256:
            raise ChecksumError(
                f"patch {entry.name} in {path} was modified: sha256 {actual[:12]}… does not "
                f"match the manifest's {entry.sha256[:12]}…; refusing to use it"
            )
        files = patch_paths(data, patch=entry.name)
        patches.append(Patch(entry.name, entry.concern, actual, tuple(files), data))
    return PatchSet(
        name=manifest.name,
        version=manifest.version,
        created=manifest.created,
        base_version=manifest.base.sglang,
        base_tree=manifest.base.tree,
        patches=tuple(patches),
        path=path,
    )
