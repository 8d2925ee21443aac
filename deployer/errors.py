"""One error root for the whole tool; the CLI maps it to a message and an exit code.

Every message is one line that says what happened, where (file, host, patch) and what to do.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    """Every exit status of `ddeploy` (docs/remote.md lists them for scripts)."""

    OK = 0
    FAILURE = 1  # hosts failed in different ways, or an internal error
    USAGE = 2
    INVENTORY = 3
    PATCH_SET = 4
    CONNECT = 5
    REMOTE_COMMAND = 6
    STATE = 7  # drift, conflict, lock, nothing applied / launched
    BUILD = 8
    RENDER = 9
    TESTS_FAILED = 10
    BASE_TREE = 11
    GREEDY_MISMATCH = 12  # bench: DDTree's greedy tokens differ from the baseline's
    INTERRUPTED = 130


class DeployError(Exception):
    """Base of every error the tool reports to a user."""

    exit_code: ExitCode = ExitCode.FAILURE

    def __init__(self, message: str, *, host: str | None = None, data: dict[str, Any] | None = None):
        super().__init__(message)
        self.host = host
        self.data = data or {}  # what the failed operation produced (e.g. a test record), for --json

    def __str__(self) -> str:  # one line, host-prefixed when we know the host
        msg = " ".join(super().__str__().split("\n"))
        return f"[{self.host}] {msg}" if self.host else msg


class UsageError(DeployError):
    """Bad CLI arguments or combinations."""

    exit_code = ExitCode.USAGE


class InventoryError(DeployError):
    """A host file is missing, malformed or names an unknown host/group."""

    exit_code = ExitCode.INVENTORY


class PatchSetError(DeployError):
    """A patch set is missing, tampered with, malformed or unsafe."""

    exit_code = ExitCode.PATCH_SET


class PathSafetyError(PatchSetError):
    """A patch touches a path outside the checkout, under .git/, absolute, or a symlink."""


class ChecksumError(PatchSetError):
    """A patch's sha256 does not match its manifest."""


class BaseTreeError(DeployError):
    """The pristine SGLang base cannot be built or does not match its recorded hash."""

    exit_code = ExitCode.BASE_TREE


class ConnectError(DeployError):
    """A host cannot be reached, refuses auth, or presents an unknown/changed host key."""

    exit_code = ExitCode.CONNECT


class RemoteCommandError(DeployError):
    """A command on a host exited non-zero."""

    exit_code = ExitCode.REMOTE_COMMAND


class StateError(DeployError):
    """The checkout on a host is not in a state the operation accepts (drift, conflict, lock)."""

    exit_code = ExitCode.STATE


class LockError(StateError):
    """Another deploy holds the checkout's lock."""


class DriftError(StateError):
    """Hand edits on the host block the operation (use --force to save them and go on)."""


class ConflictError(StateError):
    """A patch does not apply strictly to the host's checkout."""


class BuildError(DeployError):
    """Kernel build failed or cannot run for this host (arch, nvcc)."""

    exit_code = ExitCode.BUILD


class RenderError(DeployError):
    """A launch script cannot be rendered for this host/topology."""

    exit_code = ExitCode.RENDER


class HostsFailed(DeployError):
    """One or more hosts of a fleet operation failed (details were already printed); the exit code
    is the failures' own when they are all of one kind."""

    def __init__(self, message: str, *, exit_code: ExitCode = ExitCode.FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


class OverlayTestsFailed(DeployError):
    """The overlay's own tests failed inside a patched tree."""

    exit_code = ExitCode.TESTS_FAILED


class GreedyMismatchError(DeployError):
    """`ddeploy bench`: at temperature 0 the tree's completion differs from the baseline's."""

    exit_code = ExitCode.GREEDY_MISMATCH
