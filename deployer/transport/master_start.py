"""Starting a connection master (control_master.py) for the hosts of a command without a kept
connection, and waiting for it to report each host.

The master imports deployer exactly as this process did: it is given this process's sys.path
whole (a PYTHONPATH, a user site, a zipapp, a venv), not the interpreter's defaults. Its stderr
goes to a log file next to its sockets (in the 0700 directory), named in any error about it. A
master that cannot start, or ends before it has reported a host, is not that host's failure:
the command connects to the host directly (as OpenSSH's `ControlMaster auto`), with one note.

    start = MasterStart(hosts, paths, persist, timeouts, directory)
    if start.wait(host) is not None: ...   # the master is gone: a line saying so; connect directly
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConnectError
from .control_paths import absolute_source
from .timeouts import Timeouts

if TYPE_CHECKING:
    from ..inventory import Host

MASTER_MODULE = "deployer.transport.control_master"
# Only `sys` (built in) is imported before the path is set: nothing is found in the cwd first.
BOOT = "import sys; sys.path[:] = {path!r}; from {module} import main; main()"


def master_argv() -> list[str]:
    """The master's command line: this interpreter, this process's import path."""
    return [sys.executable, "-c", BOOT.format(path=list(sys.path), module=MASTER_MODULE)]


def master_request(hosts: list[Host], paths: dict[str, Path], persist: float, timeouts: Timeouts, log: Path) -> bytes:
    """What the master reads on stdin: what the SSH layer needs of each host, its socket, and
    the master's own log (removed at its end when empty)."""
    from .endpoint import SSHEndpoint

    entries = [
        {"endpoint": replace(SSHEndpoint.of(h), source=absolute_source(h)).to_json(), "path": str(paths[h.name])}
        for h in hosts
    ]
    request = {"persist": persist, "timeouts": asdict(timeouts), "hosts": entries, "log": str(log)}
    return json.dumps(request).encode()


class MasterStart:
    """A connection master being started for some hosts: it reports each host on its stdout as
    one JSON line ({"host", "error"}) as soon as that host is connected or has failed."""

    def __init__(self, hosts: list[Host], paths: dict[str, Path], persist: float, timeouts: Timeouts, log_dir: Path):
        self.names = {h.name for h in hosts}  # the hosts this master connects
        self._done: dict[str, str | None] = {}  # host -> None (connected) or its error line
        self._ended = False  # the master's stdout closed
        self._cond = threading.Condition()
        self._proc: subprocess.Popen | None = None
        fd, name = tempfile.mkstemp(prefix="master-", suffix=".log", dir=log_dir)
        self.log = Path(name)
        try:
            self._spawn(fd, master_request(hosts, paths, persist, timeouts, self.log))
        except OSError as exc:
            self.log.write_text(f"could not start {master_argv()[0]}: {exc}\n")
            self._ended = True
            return
        finally:
            os.close(fd)
        threading.Thread(target=self._read, name="control-master", daemon=True).start()

    def _spawn(self, log_fd: int, request: bytes) -> None:
        # A session of its own: the terminal's Ctrl-C stops the command, not the connections it keeps.
        self._proc = subprocess.Popen(
            master_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fd, start_new_session=True
        )
        try:
            self._proc.stdin.write(request + b"\n")
            self._proc.stdin.close()
        except OSError:
            pass  # it ended at once: its log says why, and its stdout closes

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                report = json.loads(line)
                name, error = str(report["host"]), report.get("error")
            except (ValueError, KeyError, TypeError):
                continue
            with self._cond:
                self._done[name] = None if error is None else str(error)
                self._cond.notify_all()
        self._proc.stdout.close()  # every host reported, or the master ended
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, host: Host) -> str | None:
        """Until the master has connected `host`: None, or raises the host's ConnectError (one
        line); or, when the master ended first, the line that says so (connect directly)."""
        with self._cond:
            while host.name not in self._done and not self._ended:
                self._cond.wait()
            error = self._done.get(host.name)
            if host.name not in self._done:
                return self._gone()
        if error is not None:
            raise ConnectError(error, host=host.name)
        return None

    def _gone(self) -> str:
        try:
            code = self._proc.wait(timeout=5) if self._proc is not None else None
        except subprocess.TimeoutExpired:
            code = "none: its output closed"
        how = "could not start" if self._proc is None else f"ended (exit status {code})"
        return f"the connection master {how} before connecting; connecting directly (its log: {self.log})"
