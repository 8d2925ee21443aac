"""Connections opened, and agents started, while the client still prepares its request (the SSH
handshake, the host's login shell and Python's start-up overlap the client's own work)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .agent_client import AgentSession
from .control import Connector

if TYPE_CHECKING:
    from ..inventory import Host


class EarlyAgents:
    """Connections opened while the client still prepares the request, and the agents started on
    them as soon as the client knows what it will ask (`start(op)`), before the request exists.

    Most of a push's time on a host is the SSH handshake, the host's login shell and Python's
    start-up. None of that needs the request, so it runs beside the client's own work (verifying
    the patch set, importing what the call needs, building the request) instead of after it.
    Nothing runs on a host before `start`: a command whose input turns out bad (a tampered patch
    set) has only connected. Each host connects in its own
    thread; a failure (ConnectError) is raised where the session is taken, so it is reported per
    host as before. Sessions never taken (the client failed, --fail-fast) are closed; an agent
    that was started reads no request and ends without touching the checkout.

        with EarlyAgents(hosts[:parallel]) as early:  # handshakes begin
            ps = load_patch_set(...)                  # verified while they run
            early.start("push")                       # shells and agents start
            with agent_session(host, early=early) as agent: agent.call("push", {...})
    """

    def __init__(
        self,
        hosts: list[Host],
        *,
        accept_new_host_keys: bool = False,
        command: str = "ddeploy",
    ):
        self.accept_new_host_keys, self.command = accept_new_host_keys, command
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._op: str | None = None
        self._closed = False
        self._futures: dict[str, Future[AgentSession]] = {}
        # one connection master for every host without a kept connection (control.py)
        self._connector = Connector(hosts, accept_new_host_keys=accept_new_host_keys)
        for host in hosts:
            if host.is_local or host.name in self._futures:
                continue  # nothing to hide on this machine
            future: Future[AgentSession] = Future()
            self._futures[host.name] = future
            thread = threading.Thread(target=self._open, args=(host, future), name=f"early-{host.name}", daemon=True)
            thread.start()

    def _open(self, host: Host, future: Future) -> None:
        try:
            conn = self._connector.open(host)
            session = AgentSession(conn, host, self.command)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the session
            future.set_exception(exc)
            return
        self._go.wait()  # start() or close()
        try:
            if self._op is not None and not self._closed:
                session.start(self._op)
        except BaseException as exc:  # noqa: BLE001
            session.conn.close()
            future.set_exception(exc)
            return
        with self._lock:
            abandoned = self._closed
            if not abandoned:
                future.set_result(session)
        if abandoned:
            session.conn.close()

    def start(self, op: str) -> None:
        """Start the agent for `op` on each host as soon as it is connected; returns at once (the
        client's own work goes on beside the hosts' shells and interpreters starting)."""
        self._op = op
        self._go.set()

    def take(self, host: Host) -> AgentSession | None:
        """The host's early session (waiting for its connect), or None if it has none; raises the
        connect's error."""
        self._go.set()  # without a start(), sessions come without a started agent
        with self._lock:
            future = None if self._closed else self._futures.pop(host.name, None)
        return future.result() if future is not None else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left, self._futures = list(self._futures.values()), {}
        self._go.set()
        for future in left:
            if future.done() and future.exception() is None:
                future.result().conn.close()
            # not done yet: _open closes it when it gets there

    def __enter__(self) -> "EarlyAgents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
