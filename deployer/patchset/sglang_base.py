"""The pristine SGLang base: the 0.5.23 wheel's `sglang/` package under `python/sglang/`,
committed once to a fresh git repository with a fixed identity, so the commit is the same
on every machine. The recorded tree hash detects a corrupted or different base."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import BaseTreeError
from .local_git import FIXED_IDENTITY, git, git_env, git_out
from ..locations import cache_dir

SGLANG_VERSION = "0.5.23"
# `git rev-parse HEAD^{tree}` of the base built from sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl.
BASE_TREE_HASHES = {
    "0.5.23": "2013599e516e1b533b2b294160f9d65a9af1f130",
}
COMMIT_MESSAGE = "SGLang {v} pristine base (the PyPI wheel's sglang/ under python/sglang/)\n"


@dataclass(frozen=True)
class Base:
    version: str
    path: Path  # the git repository (with a work tree)
    commit: str
    tree: str


def wheel_dir() -> Path:
    return cache_dir() / "wheels"


def base_repo_dir(version: str = SGLANG_VERSION) -> Path:
    return cache_dir() / "base" / f"sglang-{version}"


def find_wheel(version: str = SGLANG_VERSION) -> Path | None:
    explicit = os.environ.get("DDEPLOY_SGLANG_WHEEL")
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise BaseTreeError(f"DDEPLOY_SGLANG_WHEEL={explicit} is not a file")
        return p
    found = sorted(wheel_dir().glob(f"sglang-{version}-*.whl"))
    return found[0] if found else None


def download_wheel(version: str = SGLANG_VERSION) -> Path:
    """Fetch the wheel with pip (no deps) into the cache; a clear error when offline."""
    wheel_dir().mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(wheel_dir()),
        f"sglang=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(version)
    if proc.returncode != 0 or wheel is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BaseTreeError(
            f"cannot get the SGLang {version} wheel ({last}); put sglang-{version}-*.whl in "
            f"{wheel_dir()} or set DDEPLOY_SGLANG_WHEEL"
        )
    return wheel


def unpack_package(wheel: Path, dest: Path) -> int:
    """Unpack the wheel's `sglang/` package into dest/python/sglang; return the file count."""
    count = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                name = info.filename
                if not name.startswith("sglang/") or name.endswith("/"):
                    continue
                parts = Path(name).parts
                if any(p in ("..", "") for p in parts) or name.startswith("/"):
                    raise BaseTreeError(f"wheel {wheel.name} has an unsafe path {name!r}")
                target = dest / "python" / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                mode = (info.external_attr >> 16) & 0o777
                target.chmod(0o755 if mode & stat.S_IXUSR else 0o644)
                count += 1
    except zipfile.BadZipFile as exc:
        raise BaseTreeError(f"{wheel} is not a valid wheel: {exc}") from exc
    if count == 0:
        raise BaseTreeError(f"{wheel} has no sglang/ package")
    return count


def commit_tree(repo: Path, version: str) -> None:
    git(repo, "init", "-q", "-b", "main")
    for key, value in (
        ("core.autocrlf", "false"),
        ("core.fileMode", "true"),
        ("user.name", "ddeploy"),
        ("user.email", "ddeploy@localhost"),
    ):
        git(repo, "config", key, value)
    git(repo, "add", "-A", "-f", ".")  # -f: the wheel ships .gitignore files of its own
    git(repo, "commit", "-q", "--no-verify", "-m", COMMIT_MESSAGE.format(v=version), env=FIXED_IDENTITY)


def verify_base(path: Path, version: str = SGLANG_VERSION) -> Base:
    """Check the repository at path is the recorded pristine base, untouched."""
    if not (path / ".git").exists():
        raise BaseTreeError(f"{path} is not a git repository; run `ddeploy base fetch`")
    tree = git_out(path, "rev-parse", "HEAD^{tree}", check=False)
    expected = BASE_TREE_HASHES.get(version)
    if expected and tree != expected:
        raise BaseTreeError(
            f"base at {path} has tree {tree or '?'}, expected {expected} for SGLang "
            f"{version}; rebuild it with `ddeploy base fetch --rebuild`"
        )
    git(path, "update-index", "-q", "--refresh", check=False)
    dirty = git_out(path, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        first = dirty.splitlines()[0]
        raise BaseTreeError(
            f"base at {path} has local changes ({first.strip()}); rebuild it with `ddeploy base fetch --rebuild`"
        )
    return Base(version, path, git_out(path, "rev-parse", "HEAD"), tree)


def build_base(version: str = SGLANG_VERSION, *, wheel: Path | None = None) -> Path:
    """Build the base repository into the cache (atomically: a temp dir renamed into place)."""
    wheel = wheel or find_wheel(version) or download_wheel(version)
    final = base_repo_dir(version)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".sglang-{version}-", dir=final.parent))
    try:
        unpack_package(wheel, tmp)
        commit_tree(tmp, version)
        if final.is_symlink():  # a linked-in shared base: replace the link, never its target
            final.unlink()
        elif final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_base(version: str = SGLANG_VERSION, *, rebuild: bool = False) -> Base:
    """Return the verified cached base, building it on first use (or when asked)."""
    path = base_repo_dir(version)
    if rebuild or not (path / ".git").exists():
        build_base(version)
    return verify_base(path, version)


def fetch_base(version: str = SGLANG_VERSION, *, rebuild: bool = False) -> Base:
    """`ddeploy base fetch`: build (or rebuild) the cached base and verify it."""
    return ensure_base(version, rebuild=rebuild)


def clone_base(dest: Path, version: str = SGLANG_VERSION, *, source: Path | None = None, checkout: bool = True) -> Path:
    """A fresh, full (not shallow) clone of the base at dest: a checkout to deploy onto.

    `source` clones another repository instead (a host checkout, a test's altered base); it is
    only read, never modified. `checkout=False` makes a cheap scratch clone for index-only work
    (`git apply --cached`): objects shared with the source, the index read from HEAD, no files
    written; it must not outlive the source."""
    origin = source if source is not None else ensure_base(version).path
    if not (Path(origin) / ".git").exists():
        raise BaseTreeError(f"{origin} is not a git checkout to clone")
    dest.parent.mkdir(parents=True, exist_ok=True)
    extra = [] if checkout else ["--no-checkout", "--shared"]
    proc = subprocess.run(
        ["git", "clone", "-q", *extra, str(origin), str(dest)], capture_output=True, text=True, env=git_env()
    )
    if proc.returncode != 0:
        raise BaseTreeError(f"cannot clone {origin} into {dest}: {proc.stderr.strip()}")
    if not checkout:
        git(dest, "read-tree", "HEAD")
    return dest
