"""A link with a real round trip: TCP forwarders that hold every chunk for a one-way delay.

    with DelayProxy(rtt_s=0.030) as link:
        port = link.forward("127.0.1.31", ("127.0.0.31", 2222))   # listens on 127.0.1.31:port
        link.ping_pong()                                          # -> ~0.030 s (a measured round trip)

Each forwarder listens on its own loopback address (port chosen by the kernel) and connects every
client it accepts to the target. Each direction of a connection keeps its byte stream and order:
a chunk read at time t is written at t + rtt/2, so a request and its reply cost one rtt, while
bytes still stream (latency, not a bandwidth cap). An end of stream is passed on after the same
delay. All forwarders share one event loop on a thread of its own; `close` stops them and every
connection through them. Nothing shared is touched (no netem on lo): other processes' loopback
traffic keeps its speed.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time

CHUNK = 256 * 1024


class DelayProxy:
    """Delaying TCP forwarders on one event loop thread."""

    def __init__(self, rtt_s: float):
        self.delay = rtt_s / 2
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.Server] = []
        self._links: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._thread.start()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def forward(self, listen: str, target: tuple[str, int]) -> int:
        """Listen on `listen` (a loopback address, a free port); forward to target. Returns the port."""
        return self._call(self._listen(listen, target))

    async def _listen(self, address: str, target: tuple[str, int]) -> int:
        server = await asyncio.start_server(lambda r, w: self._accept(r, w, target), address, 0, backlog=256)
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def _accept(self, client_r, client_w, target: tuple[str, int]) -> None:
        task = asyncio.current_task()
        self._links.add(task)
        try:
            await self._link(client_r, client_w, target)
        except asyncio.CancelledError:
            pass  # close() cut it; not re-raised, or asyncio's stream callback logs it as an error
        finally:
            client_w.close()
            self._links.discard(task)

    async def _link(self, client_r, client_w, target: tuple[str, int]) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            return  # the client sees its connection closed, as with a host that refuses
        try:
            await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))
        finally:
            server_w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: each chunk is written `delay` after it was read, in order; EOF too."""
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._read_into(reader, queue))
        try:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(due - self._loop.time())
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()  # half-close: the other direction may still be talking
        except (ConnectionError, OSError):
            writer.close()
        finally:
            pump.cancel()

    async def _read_into(self, reader: asyncio.StreamReader, queue: asyncio.Queue) -> None:
        while True:
            try:
                data = await reader.read(CHUNK)
            except (ConnectionError, OSError):
                data = b""  # a reset reads as the end of the stream, delayed like any byte
            queue.put_nowait((self._loop.time() + self.delay, data))
            if not data:
                return

    def ping_pong(self, count: int = 5) -> float:
        """Median round trip of one byte through a forwarder to an echo listener (the link's rtt)."""
        echo = self._call(asyncio.start_server(_echo, "127.0.0.1", 0))
        self._servers.append(echo)
        port = self.forward("127.0.0.1", ("127.0.0.1", echo.sockets[0].getsockname()[1]))
        trips = []
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count + 1):  # the first trip also waits for the forwarder's connect
                t0 = time.perf_counter()
                s.sendall(b"x")
                if s.recv(1) != b"x":
                    raise RuntimeError("the delay proxy's echo check got no echo")
                trips.append(time.perf_counter() - t0)
        return statistics.median(trips[1:])

    def cpu_seconds(self) -> float:
        """CPU time the forwarders' thread has used (so a reader can tell the proxy was no bottleneck)."""
        return self._call(_thread_time())

    def close(self) -> None:
        """Stop listening, cut every connection through the forwarders, end the loop's thread."""
        if self._loop.is_closed():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _shutdown(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _thread_time() -> float:
    return time.thread_time()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (asyncio.CancelledError, ConnectionError):
        pass  # close() cut it (see _accept)
    finally:
        writer.close()
