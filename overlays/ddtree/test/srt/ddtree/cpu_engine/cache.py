"""Built test artefacts kept across runs, keyed by the content of their inputs.

The CPU tree (a patched SGLang copy, byte-compiled) and the tiny models cost
seconds to build and are the same from run to run until an input changes, so
they are built once into ``<cache>/<kind>/<key>`` and reused:

* ``key`` is a SHA-256 over everything the artefact is made from (file contents,
  relative paths, parameters, the builder's own source); a changed input is a
  new key, so a stale artefact is never served;
* a build writes into a staging directory beside the entry and renames it into
  place, so a crashed build leaves nothing half-written, and two processes
  building the same key (two pytest-xdist workers) both end with one whole entry;
* each use touches the entry; only the :data:`KEEP` most recently used entries
  of a kind are kept.

``<cache>`` is ``$DDTREE_TEST_CACHE_DIR``, else ``$XDG_CACHE_HOME/ddeploy/cpu-engine``
(``~/.cache/ddeploy/cpu-engine``): outside any test's tmp dir, so a later run
(and a test host's ``ddeploy test --remote`` or ``cpu-tiny`` launch) finds it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Union

KEEP = 6
Part = Union[str, bytes, Path]


def cache_root() -> Path:
    explicit = os.environ.get("DDTREE_TEST_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "ddeploy" / "cpu-engine"


def _files(path: Path) -> Iterable[Path]:
    if path.is_file():
        yield path
        return
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".pyc"):
                yield Path(root) / name


def content_key(*parts: Part) -> str:
    """SHA-256 (hex, 16 chars) of ``parts``: strings and bytes as they are, a
    path as the relative names and contents of the files under it (compiled
    bytecode and ``__pycache__`` left out)."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            for path in _files(part):
                name = path.relative_to(part).as_posix() if path != part else ""
                digest.update(f"\0file {name}\0".encode())
                digest.update(path.read_bytes())
        else:
            data = part.encode() if isinstance(part, str) else part
            digest.update(b"\0part\0" + data)
    return digest.hexdigest()[:16]


def cached(kind: str, key: str, build: Callable[[Path], None]) -> Path:
    """The entry ``<cache>/<kind>/<key>``, built by ``build(staging_dir)`` when
    missing; ``build`` gets an empty directory to fill."""
    home = cache_root() / kind
    entry = home / key
    if entry.is_dir():
        os.utime(entry)
        return entry
    home.mkdir(parents=True, exist_ok=True)
    staging = home / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        build(staging)
        try:
            staging.rename(entry)
        except OSError:
            if not entry.is_dir():  # not "another process won the race"
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _prune(home, keep=entry)
    return entry


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune(home: Path, keep: Path) -> None:
    """Keep the :data:`KEEP` most recently used entries; drop the staging dirs of
    builders that died."""
    for staging in home.glob(".*.tmp"):
        pid = staging.name.split(".")[-2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)
    entries = [p for p in home.iterdir() if p.is_dir() and not p.name.startswith(".")]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
