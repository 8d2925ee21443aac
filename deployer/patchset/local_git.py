"""Run git locally with a clean, predictable environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..errors import DeployError

# Fixed identity/dates make commits we create reproducible byte for byte.
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "ddeploy",
    "GIT_AUTHOR_EMAIL": "ddeploy@localhost",
    "GIT_COMMITTER_NAME": "ddeploy",
    "GIT_COMMITTER_EMAIL": "ddeploy@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
}


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"})
    env.update(extra or {})
    return env


def git(
    repo: Path | str, *args: str, input: bytes | None = None, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `git -C repo args...`; raise DeployError with git's own message on failure."""
    proc = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, env=git_env(env))
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise DeployError(f"git {args[0]} failed in {repo}: {err[-1] if err else 'exit ' + str(proc.returncode)}")
    return proc


def git_out(repo: Path | str, *args: str, **kw) -> str:
    return git(repo, *args, **kw).stdout.decode().strip()
