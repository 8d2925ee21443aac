"""ServerAliveInterval x ServerAliveCountMax, kept as ssh keeps them: a dead link is closed.

    watch = Keepalive.start(transport, "root@10.0.0.1:22", interval=15, count=3)  # None when 0
    watch.reason   # None, or the one line that says why the link was closed
    watch.stop()

Every `interval` seconds a `keepalive@openssh.com` global request that wants a reply is sent
(sshd answers it, with a failure, as it answers OpenSSH's own). When `count` intervals pass with a
probe unanswered, the transport is closed, so a command blocked on the link fails at once instead
of waiting for TCP to give up (on a partitioned host that is many minutes: the kernel keeps
retransmitting). paramiko's global_request(wait=True) has no timeout, so the probe waits in a
thread of its own, one probe at a time, and the watcher counts the intervals it stays unanswered.

When no ssh_config sets ServerAliveInterval, ddeploy probes every 15 s (OpenSSH's default is 0:
off): a deploy drives many hosts at once, and one partitioned host must fail in under a minute
(15 s x 3) rather than hold the whole run for TCP's retransmission timeout.
"""

from __future__ import annotations

import threading

DEFAULT_INTERVAL = 15  # seconds; ddeploy's, when the ssh_config sets no ServerAliveInterval
DEFAULT_COUNT = 3  # OpenSSH's ServerAliveCountMax


def alive_settings(options, default_interval: int, convtime) -> tuple[int, int]:
    """(interval, count) from a hop's ssh_config lookup: ServerAliveInterval (a time; 0 = off),
    else `default_interval`; ServerAliveCountMax, else 3 (0 is read as 1). ValueError if not numbers."""
    raw = options.get("serveraliveinterval")
    interval = convtime(raw, "ServerAliveInterval") if raw is not None else default_interval
    raw_count = str(options.get("serveralivecountmax", DEFAULT_COUNT))
    if not raw_count.isdigit():
        raise ValueError(f"ServerAliveCountMax {raw_count!r} is not a whole number")
    return interval, max(int(raw_count), 1)


class Keepalive:
    """A daemon thread that probes one transport and closes it after `count` unanswered intervals."""

    def __init__(self, transport, where: str, interval: float, count: int):
        self.transport, self.where, self.interval, self.count = transport, where, interval, count
        self.reason: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"keepalive {where}", daemon=True)

    @classmethod
    def start(cls, transport, where: str, interval: float, count: int) -> Keepalive | None:
        """A running watcher, or None when the interval is 0 (keepalives off, as in ssh)."""
        if interval <= 0:
            return None
        watch = cls(transport, where, interval, count)
        watch._thread.start()
        return watch

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        probe, missed = None, 0
        while not self._stopped.wait(self.interval) and self.transport.is_active():
            if probe is not None and probe.is_alive():  # the last probe is still unanswered
                missed += 1
                if missed >= self.count:
                    return self._close()
                continue
            missed = 0
            probe = threading.Thread(target=self._probe, name=f"keepalive probe {self.where}", daemon=True)
            probe.start()

    def _probe(self) -> None:
        try:  # returns on the reply (success or failure alike) or when the transport closes
            self.transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # noqa: BLE001, S110 - a closed link: the watcher sees the transport inactive
            pass

    def _close(self) -> None:
        seconds = self.interval * self.count
        self.reason = (
            f"no reply from {self.where} for {seconds:g} s (ServerAliveInterval {self.interval:g} s x "
            f"ServerAliveCountMax {self.count}); the link is down"
        )
        self.transport.close()
