"""The ssh_config files read as OpenSSH reads them, `Include` included (paramiko 5's SSHConfig keeps
`include` as an unknown option and reads nothing more).

    config = load_ssh_config(runtime, user, system)    # a paramiko SSHConfig

The file named for a host (`-F`) alone; otherwise the user's file, then the system's (each parsed on
its own, so one file's last block does not run on into the next; a setting's first value wins).
`Include FILE...` is replaced by the files' lines: a relative name is under ~/.ssh in the user's
file and in a file named for the host (ssh reads both as user files), under /etc/ssh in the system's;
`~` and glob patterns are expanded, matches read in lexical order, a name that matches nothing is
skipped, and nesting stops at 16 levels, as in ssh. After an Include the block it stood in is
restated. An Include inside a Host or Match block applies only there: the included file's own
Host/Match lines become `Match` lines that also require the enclosing block's criteria (a Host
pattern list is `originalhost`, what Host matches).
"""

from __future__ import annotations

import glob
import io
import os
import re
import shlex
from pathlib import Path

from paramiko import SSHConfig

from .known_hosts import tilde

MAX_DEPTH = 16  # ssh's READCONF_MAX_DEPTH
_KEYWORD = re.compile(r"\s*(\w+)(?:\s*=\s*|\s+)(.*)")


def load_ssh_config(runtime: str | None, user: str, system: str) -> SSHConfig:
    """The SSHConfig of the file named for the host alone, else of the user's and the system's."""
    config = SSHConfig()
    user_dir = tilde("~/.ssh")
    files = [(runtime, user_dir)] if runtime else [(os.path.expanduser(user), user_dir), (system, "/etc/ssh")]
    for path, base in files:
        if path and os.path.isfile(path):
            config.parse(io.StringIO("\n".join(expand(Path(path), base)) + "\n"))
    return config


def expand(path: Path, base: str, outer: str | None = None, depth: int = 0) -> list[str]:
    """The file's lines with each Include replaced by its files' lines. `outer`: the criteria of
    the block the file was included from (None: at the top of a file)."""
    out: list[str] = []
    header, criteria = None, outer  # the block line in force, as written out, and its criteria
    for number, line in enumerate(path.read_text().splitlines(), 1):
        key, value = _keyword(line)
        if key in ("host", "match"):
            criteria = _join(outer, _criteria(key, value))
            header = line if outer is None else f"Match {criteria or 'all'}"
            out.append(header)
        elif key == "include":
            for lines in _included(value, base, criteria, depth, f"{path} line {number}"):
                out += [*lines, header or (f"Match {outer}" if outer else "Host *")]  # back in this block
        else:
            out.append(line)
    return out


def _keyword(line: str) -> tuple[str, str]:
    m = _KEYWORD.match(line)
    return (m.group(1).lower(), m.group(2).strip()) if m and not line.lstrip().startswith("#") else ("", "")


def _included(value: str, base: str, criteria: str | None, depth: int, where: str) -> list[list[str]]:
    """The lines of each file an Include names, file by file."""
    if depth >= MAX_DEPTH:
        raise ValueError(f"{where}: Include nested more than {MAX_DEPTH} levels deep")
    files = []
    for name in shlex.split(value):
        pattern = os.path.join(base, tilde(name))  # an absolute name stays as it is
        files += [file for file in sorted(glob.glob(pattern)) if os.path.isfile(file)]
    return [expand(Path(file), base, criteria, depth + 1) for file in files]


def _criteria(key: str, value: str) -> str | None:
    """A Host or Match line's criteria as Match criteria (None: every host)."""
    if key == "host":
        patterns = value.split()
        return None if patterns == ["*"] else "originalhost " + ",".join(patterns)
    return None if value.lower() == "all" else value


def _join(outer: str | None, inner: str | None) -> str | None:
    return " ".join(c for c in (outer, inner) if c) or None
