"""Who is at the other end of a Unix socket: the platform's peer-credential call where it has
one (Linux SO_PEERCRED; macOS and the BSDs LOCAL_PEERCRED, what getpeereid reads), else None.

Where there is none the socket directory's 0700 mode is the guard, as OpenSSH relies on it for
its control sockets. Standard library only.

    uid = peer_uid(client)   # None: this platform cannot tell; OSError: the call failed
"""

from __future__ import annotations

import socket
import struct
import sys

# <sys/un.h> on macOS and FreeBSD: SOL_LOCAL 0, LOCAL_PEERCRED 1; struct xucred begins with
# u_int cr_version, uid_t cr_uid (Python's socket module names neither).
SOL_LOCAL, LOCAL_PEERCRED = 0, 1
XUCRED_HEAD = "II"  # cr_version, cr_uid: the two fields read
XUCRED_SIZE = 76  # the whole struct: version, uid, ngroups (short, padded), 16 gids


def peer_uid(client: socket.socket) -> int | None:
    """The uid of the process at the other end of `client`, or None where the platform has no
    way to ask (the directory's mode then guards the socket)."""
    if hasattr(socket, "SO_PEERCRED"):  # Linux: struct ucred {pid, uid, gid}
        creds = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[1]
    if sys.platform == "darwin" or sys.platform.startswith("freebsd"):
        creds = client.getsockopt(SOL_LOCAL, LOCAL_PEERCRED, XUCRED_SIZE)
        return struct.unpack_from(XUCRED_HEAD, creds)[1]
    return None
