"""One error root for the whole tool; the CLI maps it to a message and an exit code.

Every message is one line that says what happened, where (file, host, patch) and what to do.
"""

from __future__ import annotations


class DeployError(Exception):
    """Base of every error the tool reports to a user."""

    exit_code = 1

    def __init__(self, message: str, *, host: str | None = None):
        super().__init__(message)
        self.host = host

    def __str__(self) -> str:  # one line, host-prefixed when we know the host
        msg = " ".join(super().__str__().split("\n"))
        return f"[{self.host}] {msg}" if self.host else msg


class UsageError(DeployError):
    """Bad CLI arguments or combinations."""

    exit_code = 2


class InventoryError(DeployError):
    """A host file is missing, malformed or names an unknown host/group."""

    exit_code = 3


class PatchSetError(DeployError):
    """A patch set is missing, tampered with, malformed or unsafe."""

    exit_code = 4


class PathSafetyError(PatchSetError):
    """A patch touches a path outside the checkout, under .git/, absolute, or a symlink."""


class ChecksumError(PatchSetError):
    """A patch's sha256 does not match its manifest."""


class BaseTreeError(DeployError):
    """The pristine SGLang base cannot be built or does not match its recorded hash."""

    exit_code = 4


class ConnectError(DeployError):
    """A host cannot be reached, refuses auth, or presents an unknown/changed host key."""

    exit_code = 5


class RemoteCommandError(DeployError):
    """A command on a host exited non-zero."""

    exit_code = 6


class StateError(DeployError):
    """The checkout on a host is not in a state the operation accepts (drift, conflict, lock)."""

    exit_code = 7


class LockError(StateError):
    """Another deploy holds the checkout's lock."""


class DriftError(StateError):
    """Hand edits on the host block the operation (use --force to save them and go on)."""


class ConflictError(StateError):
    """A patch does not apply strictly to the host's checkout."""


class BuildError(DeployError):
    """Kernel build failed or cannot run for this host (arch, nvcc)."""

    exit_code = 8


class RenderError(DeployError):
    """A launch script cannot be rendered for this host/topology."""

    exit_code = 9


class HostsFailed(DeployError):
    """One or more hosts of a fleet operation failed (details were already printed)."""

    exit_code = 1


class OverlayTestsFailed(DeployError):
    """The overlay's own tests failed inside a patched tree."""

    exit_code = 10
