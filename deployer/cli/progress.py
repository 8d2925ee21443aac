"""Live fleet progress: `[host] line` on stderr from worker threads, serialised; on a terminal a
footer line shows which hosts are still running (the only place that draws ANSI)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from ..ops.fleet import HostResult

Describe = Callable[[HostResult], str]


class Progress:
    def __init__(self, total: int, describe: Describe, stream=None):
        self.stream = stream or sys.stderr
        self.describe = describe
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.lock = threading.Lock()
        self.running: dict[str, float] = {}
        self.done = 0
        self.total = total
        self._stop = threading.Event()
        if self.tty:  # keep the footer's clocks moving while hosts work silently
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self.lock:
                if self.running:
                    self.stream.write("\r\x1b[K" + self._footer())
                    self.stream.flush()

    def _footer(self) -> str:
        names = ", ".join(f"{h} {time.monotonic() - t:.0f}s" for h, t in self.running.items())
        return f"[{self.done}/{self.total} done] running: {names}"

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        if self.tty and self.running:
            self.stream.write(self._footer())
        self.stream.flush()

    def line(self, host: str, text: str) -> None:
        with self.lock:
            self._write(f"[{host}] {text}")

    def start(self, host: str) -> None:
        with self.lock:
            self.running[host] = time.monotonic()
            self._write(f"[{host}] started")

    def finish(self, result: HostResult) -> None:
        with self.lock:
            self.running.pop(result.host, None)
            self.done += 1
            verdict = "ok" if result.ok else "FAILED"
            self._write(f"[{result.host}] {verdict} in {result.duration:.2f}s: {self.describe(result)}")

    def close(self) -> None:
        self._stop.set()
        if self.tty:
            with self.lock:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
