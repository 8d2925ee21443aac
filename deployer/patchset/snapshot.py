"""Dev snapshots: the overlay's working copy as an unreleased patch set, for the developer's loop
(`push --overlay`, `test --remote --overlay`).

A snapshot is exported and verified exactly like a release (export.render_set, then the loader's
checks), but versioned `<newest release>+dev.<12 hex of the content hash>` and kept in the cache
(<cache>/snapshots/<name>/<version>/), never under patches/. The content hash covers what an
export reads (concerns.yaml, the overlay files with their executable bit, hunks/) and the base
tree, so an unchanged overlay costs only hashing: the cached set is loaded again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from time import sleep

from ..errors import PatchSetError
from ..locations import cache_dir
from .export import created_date, render_set
from .overlay import CONCERNS_FILE, HUNKS_DIR, load_overlay, overlay_files
from .release import DEV_TAG, PatchSet, list_versions, load_patch_set, sets_root
from .sglang_base import BASE_TREE_HASHES, SGLANG_VERSION, ensure_base


def exported_files(overlay_path: Path) -> list[str]:
    """Every file an export reads, relative to the overlay, sorted."""
    overlay = load_overlay(overlay_path)
    hunks = overlay_path / HUNKS_DIR
    found = [p.relative_to(overlay_path).as_posix() for p in hunks.rglob("*") if p.is_file()] if hunks.is_dir() else []
    return sorted([CONCERNS_FILE, *overlay_files(overlay), *found])


def content_hash(overlay_path: Path) -> str:
    """sha256 over the base tree and each exported file's path, executable bit and bytes."""
    h = hashlib.sha256(f"sglang {SGLANG_VERSION} {BASE_TREE_HASHES.get(SGLANG_VERSION, '')}\n".encode())
    for rel in exported_files(overlay_path):
        path = overlay_path / rel
        data = path.read_bytes()
        h.update(f"{rel}\0{int(os.access(path, os.X_OK))}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def overlay_digest(overlay_path: Path) -> str:
    """content_hash, or the error that stops an export (a half-saved concerns.yaml is a state too)."""
    try:
        return content_hash(overlay_path)
    except (PatchSetError, OSError) as exc:
        return f"error: {exc}"


def wait_for_change(overlay_path: Path, digest: str, interval: float = 0.5) -> str:
    """Poll until the overlay's content differs from `digest` (`test --watch`); the new digest."""
    while True:
        sleep(interval)
        now = overlay_digest(overlay_path)
        if now != digest:
            return now


def snapshot_version(digest: str, releases: Path | None = None) -> str:
    """`<newest release>+dev.<digest[:12]>`; 0.0.0 stands for the base when nothing is released."""
    versions = list_versions(root=releases or sets_root())
    return f"{versions[-1] if versions else '0.0.0'}{DEV_TAG}{digest[:12]}"


def snapshots_root(name: str) -> Path:
    return cache_dir() / "snapshots" / name


def dev_snapshot(overlay_path: Path, releases: Path | None = None) -> PatchSet:
    """The overlay's working copy as a verified patch set, exported once per content hash."""
    if not (overlay_path / CONCERNS_FILE).is_file():
        raise PatchSetError(f"{overlay_path} is not an overlay (no {CONCERNS_FILE}); pass --overlay DIR")
    name = load_overlay(overlay_path).name
    version = snapshot_version(content_hash(overlay_path), releases)
    final = snapshots_root(name) / version
    if (final / "manifest.yaml").is_file():
        return load_patch_set(final)  # verified again: a cached snapshot is checked like a release
    return load_patch_set(export_snapshot(overlay_path, final, version))


def export_snapshot(overlay_path: Path, final: Path, version: str) -> Path:
    """Export into a temporary directory beside `final`, verify, rename into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".snapshot-{version}-", dir=final.parent))
    try:
        render_set(overlay_path, tmp, version=version, created=created_date(), base=ensure_base())
        load_patch_set(tmp)
        if not final.exists():
            tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
