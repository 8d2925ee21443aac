"""One real server per launch configuration per test session.

A CPU SGLang server takes 30-90 s to start on two cores, so the engine tests do
not start their own: each asks the session's :class:`ServerPool` for a server by
its whole launch configuration (:class:`ServerConfig`: the tree, the model, the
arguments, the environment) and every test asking for the same configuration
shares one running server. A test that must break, restart or watch a server
exit starts its own with ``server.launch_server``.

The pool keeps at most ``max_alive`` servers (each a few processes of a few
hundred MB; idle ones sleep, ``--sleep-on-idle``) and stops the least recently
used one to make room; a group of tests can ask for more (``resize``).
:meth:`ServerPool.start` begins a start without waiting, so a test can have its
next server start while it drives the current one.
A pooled server that died is an error for whoever asks for it next (its log
named), never silently replaced: a crash is a finding.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from .server import Server, StartupError, spawn_server


@dataclass(frozen=True)
class ServerConfig:
    """A server's whole launch configuration: the pool's key.

    ``python_dir`` None means the pool's tree (the CPU tree under test);
    ``name`` names the log file only and is not part of the key.
    """

    model: Path
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    python_dir: Path | None = None
    name: str = field(default="server", compare=False)

    @classmethod
    def of(
        cls,
        model: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        name: str = "server",
        python_dir: Path | None = None,
    ) -> "ServerConfig":
        return cls(
            model=Path(model),
            args=tuple(str(a) for a in args),
            env=tuple(sorted((env or {}).items())),
            python_dir=python_dir,
            name=name,
        )

    def digest(self) -> str:
        text = repr((str(self.model), self.args, self.env, str(self.python_dir)))
        return hashlib.sha256(text.encode()).hexdigest()[:8]


@dataclass
class _Entry:
    server: Server
    healthy: bool = False


class ServerPool:
    """Servers by :class:`ServerConfig`, started on first use (see module doc)."""

    def __init__(self, python_dir: Path, log_dir: Path, max_alive: int = 2,
                 timeout: float = 400):
        self.python_dir = Path(python_dir)
        self.log_dir = Path(log_dir)
        self.max_alive = max_alive
        self.timeout = timeout
        self.started: list[ServerConfig] = []  # every start, in order (docs/testing.md)
        self._entries: OrderedDict[ServerConfig, _Entry] = OrderedDict()

    def start(self, config: ServerConfig) -> None:
        """Begin starting ``config``'s server unless it runs or is starting."""
        if config in self._entries:
            self._entries.move_to_end(config)
            return
        self._make_room()
        log = self.log_dir / f"{config.name}-{config.digest()}.log"
        python_dir = config.python_dir or self.python_dir
        server = spawn_server(python_dir, config.model, config.args, log,
                              dict(config.env))
        self._entries[config] = _Entry(server)
        self.started.append(config)

    def get(self, config: ServerConfig) -> Server:
        """The running, healthy server of ``config`` (started if needed)."""
        self.start(config)
        entry = self._entries[config]
        if not entry.healthy:
            try:
                entry.server.wait_healthy(self.timeout)
            except StartupError:
                del self._entries[config]
                raise
            entry.healthy = True
        elif not entry.server.alive():
            raise StartupError(
                f"the shared server {config.name} has exited (code "
                f"{entry.server.process.returncode}; log: {entry.server.log_path})",
                entry.server.log_tail(), entry.server.process.returncode)
        return entry.server

    def each(self, configs: Sequence[ServerConfig]) -> Iterator[Server]:
        """Each configuration's server in turn, the next one starting while the
        caller drives the current one."""
        for i, config in enumerate(configs):
            server = self.get(config)
            if i + 1 < len(configs):
                self.start(configs[i + 1])
            yield server

    def resize(self, max_alive: int) -> None:
        """Keep at most ``max_alive`` servers from now on (the least recently
        used ones stop if there are more)."""
        self.max_alive = max_alive
        while len(self._entries) > max_alive:
            _, oldest = self._entries.popitem(last=False)
            oldest.server.stop()

    def stop(self, config: ServerConfig) -> None:
        entry = self._entries.pop(config, None)
        if entry is not None:
            entry.server.stop()

    def close(self) -> None:
        while self._entries:
            _, entry = self._entries.popitem(last=False)
            entry.server.stop()

    def _make_room(self) -> None:
        while len(self._entries) >= self.max_alive:
            _, oldest = self._entries.popitem(last=False)
            oldest.server.stop()
