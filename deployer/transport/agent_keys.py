"""`IdentitiesOnly yes` with an ssh-agent, as OpenSSH does it: a named IdentityFile whose public key
the agent holds is offered through the agent, never read with a passphrase prompt.

    held = agent_key_for(["~/.ssh/deploy"])   # the agent's copy of that key, or None

The public key of an IdentityFile is its `.pub` file, else the private file's own: an OpenSSH-format
key (`BEGIN OPENSSH PRIVATE KEY`) carries its public key unencrypted, so a passphrase-protected key
is matched without its passphrase. An encrypted PEM key without a `.pub` cannot be matched (ssh
cannot either).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

import paramiko

OPENSSH_MAGIC = b"openssh-key-v1\0"


def agent_key_for(identity_files: list[str]) -> paramiko.AgentKey | None:
    """The agent's copy of the first named IdentityFile whose public key the ssh-agent holds
    (paramiko offers it first, as pkey, and no other agent key); None when there is none."""
    wanted = [blob for name in identity_files if (blob := public_blob(Path(name).expanduser()))]
    if not wanted:
        return None
    held = {key.get_base64(): key for key in paramiko.Agent().get_keys()}
    return next((held[blob] for blob in wanted if blob in held), None)


def public_blob(path: Path) -> str | None:
    """The base64 public key of an IdentityFile (its `.pub`, else the private file's own), or None."""
    public = path.with_name(path.name + ".pub")
    try:
        if public.is_file():
            return next(iter(public.read_text().split()[1:2]), None)
        return _openssh_public_blob(path.read_text()) if path.is_file() else None
    except (OSError, UnicodeDecodeError):
        return None


def _openssh_public_blob(text: str) -> str | None:
    """The first public key in an OpenSSH-format private key file (read without decrypting it)."""
    if "-----BEGIN OPENSSH PRIVATE KEY-----" not in text:
        return None
    body = "".join(line for line in text.splitlines() if line and not line.startswith("-----"))
    try:
        data = base64.b64decode(body)
    except (binascii.Error, ValueError):
        return None
    if not data.startswith(OPENSSH_MAGIC):
        return None
    msg = paramiko.Message(data[len(OPENSSH_MAGIC) :])
    for _ in range(3):  # cipher name, KDF name, KDF options
        msg.get_string()
    if msg.get_int() < 1:
        return None
    return base64.b64encode(msg.get_binary()).decode()
