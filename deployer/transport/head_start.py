"""A head start for a repeated command: connect before the inventory is even read.

Most runs of `ddeploy push|plan|status|rollback` repeat an earlier command line against an
unchanged inventory. Such a run knows where it will connect long before it has imported Click and
pydantic and validated its inventory, which is most of the client's start-up. So `main()` first
looks the command up in a small hint file, <cache>/head-start.json, written by the last runs:

    head = HeadStart.begin(argv)   # before Click and pydantic: connects, starts the bootstraps
    ...                            # the CLI as usual: inventory, selection, the set verified
    EarlyAgents(hosts, head=head)  # each host takes its head-start connection if it matches
    early.start("push")            # sends the agent's program; remembers this run for the next

A hint matches only the same argv, working directory and DDEPLOY_*/XDG_*/HOME environment, and
only while every inventory file is byte for byte what it was (sha256). It holds, per host, the
settings a connection is made from (`host_record`): the ssh spec, the file it came from, the
environment and the python. A connection the head start opens is used only when the host the
validated inventory selects has exactly that record (else it is closed unused), and its bootstrap
only for the op the hint recorded (else it is closed and the agent started anew): a stale or wrong
hint costs a connection, never a different result.

What runs on a host before the command has checked its input is what `ssh host true` runs: the
login shell, and the agent's BOOTSTRAP (deployer/transport/agent_client.py), which waits for its
program on stdin and ends when it never comes. Host keys are checked as on every connection;
hosts that need --accept-new-host-keys never get a head start. Failures are never reported from
here: the connection that the command makes itself reports them, as on a run without a hint.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ..locations import cache_dir, inventory_files

if TYPE_CHECKING:
    from ..inventory import Host

HINT_FILE = "head-start.json"
HINT_FORMAT = 1
MAX_ENTRIES = 16  # command lines remembered; the oldest is forgotten first
SSH_FIELDS = ("host", "user", "port", "identity", "jump", "config")  # inventory.SSHSpec, all of it
COMMANDS = ("push", "plan", "status", "rollback")  # the commands whose hosts get an EarlyAgents


def host_record(host: Host) -> dict[str, Any]:
    """Everything a host's connection and its agent's start are made from (and nothing else)."""
    ssh = host.ssh
    return {
        "name": host.name,
        "ssh": None if ssh is None else {k: getattr(ssh, k) for k in SSH_FIELDS},
        "source": host.source,
        "env": dict(host.env),
        "python": host.python,
    }


def _stand_in(record: dict[str, Any]) -> SimpleNamespace:
    """The attributes of inventory.Host that a Connection reads, from a host_record (until the
    validated Host takes over, EarlyAgents._connect)."""
    return SimpleNamespace(**{**record, "ssh": SimpleNamespace(**record["ssh"]), "is_local": False})


def _command_key(argv: list[str]) -> str:
    environment = {k: v for k, v in os.environ.items() if k.startswith(("DDEPLOY_", "XDG_")) or k == "HOME"}
    text = json.dumps([list(argv), os.getcwd(), sorted(environment.items())])
    return hashlib.sha256(text.encode()).hexdigest()


def _fingerprint(directory: Path) -> dict[str, str]:
    """sha256 of every inventory file (the files Inventory.load reads)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in inventory_files(directory)}


def _read_hints(path: Path) -> dict[str, Any]:
    """The hint file's entries; empty when it is missing, unreadable, malformed or writable by
    anyone but this user (then it is not trusted to say where to connect)."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return {}
            doc = json.loads(fh.read())
    except (OSError, ValueError):
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) and doc.get("format") == HINT_FORMAT else None
    return entries if isinstance(entries, dict) else {}


def _matching_entry(argv: list[str]) -> tuple[str, dict[str, Any] | None]:
    key = _command_key(argv)
    entry = _read_hints(cache_dir() / HINT_FILE).get(key)
    try:
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("op"), str)
            and isinstance(entry.get("hosts"), list)
            and _fingerprint(Path(entry["inventory"])) == entry.get("files")
        ):
            return key, entry
    except (OSError, TypeError, KeyError):
        pass
    return key, None


@dataclass
class _Opened:
    record: dict[str, Any]
    future: Future = field(default_factory=Future)  # (Connection, StartedCommand)


class HeadStart:
    """This command's hint (`begin`), the connections opened from it, and `remember` for the next run."""

    def __init__(self, key: str, entry: dict[str, Any] | None = None):
        self.key, self._hit = key, entry  # the matching entry (its files were just checked)
        self.op: str | None = None
        self.inventory_dir: Path | None = None  # set by the CLI once the inventory is loaded
        self._opened: dict[str, _Opened] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def begin(cls, argv: list[str]) -> "HeadStart | None":
        """For a console run of a fleet command: a HeadStart (which has begun connecting when a
        hint matched), else None. Never raises."""
        if not any(command in argv for command in COMMANDS):
            return None
        try:
            key, entry = _matching_entry(argv)
        except Exception:  # noqa: BLE001 - a head start is an optimisation, never a failure
            return None
        head = cls(key, entry)
        if entry is not None:
            head._connect(entry)
        return head

    def _connect(self, entry: dict[str, Any]) -> None:
        try:
            from .agent_client import agent_argv  # paramiko: the one import the connect waits for
            from .connection import Timeouts, open_connection

            timeouts = Timeouts.from_env()
            hosts = [(rec, _stand_in(rec)) for rec in entry["hosts"]]
        except Exception:  # noqa: BLE001 - a malformed record: no head start
            return
        self.op = entry["op"]

        def connect(host: SimpleNamespace, opened: _Opened) -> None:
            try:
                conn = open_connection(host, timeouts=timeouts)  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 - for the command to report, if it is its host
                opened.future.set_exception(exc)
                return
            try:
                started = conn.start(agent_argv(host.python, self.op))  # the bootstrap waits for its program
            except BaseException:  # noqa: BLE001
                started = None
            with self._lock:
                unwanted = self._closed
                if not unwanted:
                    opened.future.set_result((conn, started))
            if unwanted:
                conn.close()

        for rec, host in hosts:
            opened = self._opened.setdefault(host.name, _Opened(rec))
            threading.Thread(target=connect, args=(host, opened), name=f"head-{host.name}", daemon=True).start()

    def take(self, host: Host) -> "Future | None":
        """The head-start connection for `host`, a Future of (Connection, StartedCommand or None),
        when this command's validated host has the recorded settings; None otherwise. The
        StartedCommand, when there is one, is the agent's bootstrap for `self.op`."""
        with self._lock:
            opened = None if self._closed else self._opened.pop(host.name, None)
        if opened is None:
            return None
        if opened.record != host_record(host):
            _close_when_done(opened.future)
            return None
        return opened.future

    def remember(self, op: str, hosts: list[Host]) -> None:
        """Record this command for the next identical run (a write only when something changed)."""
        if self.inventory_dir is None:
            return
        records = [host_record(h) for h in hosts if not h.is_local]
        hit = self._hit
        if hit is not None and (hit["inventory"], hit["op"], hit["hosts"]) == (str(self.inventory_dir), op, records):
            return  # begin() found this very entry, its files unchanged
        try:
            entry = {
                "inventory": str(self.inventory_dir),
                "files": _fingerprint(self.inventory_dir),
                "op": op,
                "hosts": records,
            }
            path = cache_dir() / HINT_FILE
            entries = _read_hints(path)
            if entries.get(self.key) == entry:
                return
            entries.pop(self.key, None)
            entries[self.key] = entry  # newest last
            for old in list(entries)[:-MAX_ENTRIES]:
                del entries[old]
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_name(f"{HINT_FILE}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump({"format": HINT_FORMAT, "entries": entries}, fh)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError):
            pass  # an unwritable cache only costs the next run its head start

    def close(self) -> None:
        """Close every head-start connection that was not taken."""
        with self._lock:
            self._closed = True
            left, self._opened = list(self._opened.values()), {}
        for opened in left:
            _close_when_done(opened.future)


def _close_when_done(future: Future) -> None:
    def close(done: Future) -> None:
        if done.exception() is None:
            conn, _ = done.result()
            conn.close()

    future.add_done_callback(close)
