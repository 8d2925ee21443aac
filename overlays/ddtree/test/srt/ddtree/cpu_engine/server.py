"""Start, drive and stop a real ``sglang.launch_server`` on CPU for tests.

:func:`launch_server` runs ``python -m sglang.launch_server`` from a source tree (via
``PYTHONPATH``, SGLang is never installed) with the flags a CPU test server needs,
in its own process group, logging to a file, and returns once ``/health`` answers
200 (``/health`` runs a one-token generation, so the engine really works). A
server that exits during start-up (e.g. a refused argument) raises
:class:`StartupError` with the tail of its log at once; :func:`start_expect_failure`
returns that tail for tests that assert on the refusal.

Why these flags: ``--sleep-on-idle`` (an idle 0.5.23 scheduler spins a full core),
``--disable-cuda-graph`` and ``torch_native`` attention (no GPU), float32 (bf16 tiny
models have near-ties that flip greedy output between servers), a small KV pool and
few running requests (start-up allocates them), no warm-up request (the ``/health``
that start-up waits for runs a generation already).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .cpu_tree import stub_dir_for

BASE_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--dtype", "float32",
    "--max-total-tokens", "4096",
    # A batch of 16: the tests' concurrent requests, and grammar samples.
    "--max-running-requests", "16",
    "--sleep-on-idle",
    "--host", "127.0.0.1",
    "--random-seed", "0",
    "--skip-server-warmup",
    # Requests may carry a logit processor (test_ddtree_engine_greedy_requests).
    "--enable-custom-logit-processor",
)
LOG_TAIL_LINES = 60

# /generate fields that sit beside sampling_params; every other keyword of
# Server.generate is a sampling parameter.
REQUEST_KEYS = frozenset({
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "return_text_in_logprobs", "stream", "rid", "return_hidden_states",
    "custom_logit_processor", "lora_path", "bootstrap_host", "bootstrap_room",
})


# Servers not yet stopped: stopped at interpreter exit if a test run ends abruptly.
_LIVE: set["Server"] = set()


def _stop_all_at_exit() -> None:
    for server in list(_LIVE):
        server.stop()


atexit.register(_stop_all_at_exit)


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the server if the test process dies (Linux
    PR_SET_PDEATHSIG), so a killed pytest leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class StartupError(RuntimeError):
    """The server exited or never became healthy during start-up."""

    def __init__(self, message: str, log_tail: str, returncode: int | None = None):
        super().__init__(f"{message}\n--- server log (tail) ---\n{log_tail}")
        self.log_tail = log_tail
        self.returncode = returncode  # None: still running at the timeout


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# A server binds its --port only once its engine is up (a TP 2 MLA server: some
# 45 s after it starts). An ephemeral --port (free_port) is, until then, among
# the ports the kernel hands out as the local port of every outgoing connection
# on the machine (gloo's, ZeroMQ's, the SSH tests'), and one such connection once
# took it from a fresh-clone run's server. Under attention DP, SGLang's
# processes also talk over TCP on ports it derives from --port: the DP handshake
# at --port + 13 (``DP_ATTENTION_HANDSHAKE_PORT_DELTA``, bound only while the
# server starts) and the dist-init port at --port + 233 and the six after it
# (``PortArgs.init_new``). SGLang's own random ports (nccl) lie in 22000-29999.
# So a server's --port comes from between the two, with its derived ports checked
# free and none of them a port of another server started here: the pool starts
# the next server while the current one runs, and a handshake port is bound only
# for a moment (one server's handshake once fell on the --port of the one before).
DP_PORT_OFFSETS = (0, 13, *range(233, 240))
SERVER_PORT_RANGE = range(30000, 32768 - DP_PORT_OFFSETS[-1])
_PORTS_GIVEN: set[int] = set()  # every port of every block handed out here


def free_server_port(
    args: Sequence[str] = (), host: str = "127.0.0.1", attempts: int = 64
) -> int:
    """A --port for a server started with ``args``, out of the ephemeral range;
    an attention-DP server's derived ports are free too."""
    offsets = DP_PORT_OFFSETS if "--attn-dp-size" in args else (0,)
    for port in random.sample(SERVER_PORT_RANGE, attempts):
        block = {port + offset for offset in offsets}
        if block.isdisjoint(_PORTS_GIVEN) and all(_bindable(host, p) for p in block):
            _PORTS_GIVEN.update(block)
            return port
    raise RuntimeError(f"no free port block for a server in {SERVER_PORT_RANGE}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _http(method: str, url: str, payload: Any = None, timeout: float = 600) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{method} {url}: HTTP {e.code}: {detail}") from None
    return json.loads(body) if body else None


@dataclass(eq=False)  # identity hash: kept in _LIVE
class Server:
    """A running test server (context manager: ``with launch_server(...) as s``)."""

    url: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        *,
        timeout: float = 600,
        **extra: Any,
    ) -> dict:
        """POST /generate for one prompt of token ids; the response JSON.

        Keywords in :data:`REQUEST_KEYS` go into the request, all others into
        ``sampling_params``. ``ignore_eos`` defaults to True so a request yields
        exactly ``max_new_tokens`` tokens (``output_ids``; ``meta_info`` has
        ``completion_tokens``, ``spec_verify_ct``, ``spec_accept_length``, ...).
        """
        sampling = {"max_new_tokens": int(max_new_tokens),
                    "temperature": float(temperature), "ignore_eos": True}
        request: dict[str, Any] = {"input_ids": [int(t) for t in input_ids]}
        for key, value in extra.items():
            (request if key in REQUEST_KEYS else sampling)[key] = value
        request["sampling_params"] = sampling
        return _http("POST", self.url + "/generate", request, timeout=timeout)

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
        temperature: float = 0.0, **extra: Any,
    ) -> list[dict]:
        """Send one request per prompt concurrently (so the scheduler batches
        them); the responses in prompt order."""
        barrier = threading.Barrier(len(prompts))

        def one(ids):
            barrier.wait()  # release all requests together
            return self.generate(ids, max_new_tokens, temperature, **extra)

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(one, prompts))

    def server_info(self) -> dict:
        """GET /server_info (server args plus ``internal_states``)."""
        return _http("GET", self.url + "/server_info", timeout=60)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout: float = 400) -> None:
        """Return once ``/health`` answers 200; :class:`StartupError` (the server
        stopped) if it exits first or ``timeout`` s pass."""
        try:
            _wait_healthy(self, timeout)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, grace: float = 20.0) -> None:
        """Terminate the whole process group (the server and its scheduler and
        detokenizer children); SIGKILL whatever is left after ``grace`` s."""
        _LIVE.discard(self)
        pgid = self.process.pid  # start_new_session: the group id is the pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self.process.poll()
            if not _group_alive(pgid):
                break
            time.sleep(0.2)
        else:
            _signal_group(pgid, signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # Children may outlive the leader briefly; reap the group for sure.
        for _ in range(50):
            if not _group_alive(pgid):
                break
            _signal_group(pgid, signal.SIGKILL)
            time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_env(python_dir: Path, env: Mapping[str, str] | None = None) -> dict:
    """The child environment: CPU engine on, offline, the tree and the sgl_kernel
    stand-in first on PYTHONPATH (``env`` entries override)."""
    child = dict(os.environ)
    paths = [str(Path(python_dir).resolve()), str(stub_dir_for(Path(python_dir)))]
    if child.get("PYTHONPATH"):
        paths.append(child["PYTHONPATH"])
    child.update({
        "PYTHONPATH": os.pathsep.join(paths),
        # Without it SGLang's is_cpu() is false (and RoPE imports vLLM).
        "SGLANG_USE_CPU_ENGINE": "1",
        # On a GPU host too: no CUDA device, so no CUDA code path is taken.
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        # Stopping the group looks like a child crash to the server, which would
        # then sleep 5 s for py-spy and CUDA core dumps before it exits.
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        # One OpenMP thread per rank: the core ``tp_args`` gives it. SGLang binds
        # a rank's threads only through the AMX / arm64 sgl_kernel; elsewhere
        # torch starts one thread per core in every rank, the ranks (and the
        # suite's other worker) oversubscribe the cores, and each parallel
        # region waits for a descheduled thread (docs/cpu-engine.md).
        "OMP_NUM_THREADS": "1",
    })
    child.update(env or {})
    return child


def dflash_args(draft: Path, *extra: str, budget: int | None = None,
                topk: int | None = None) -> list[str]:
    """Server arguments for DFlash with ``draft`` on CPU: linear DFLASH, or DDTree
    with ``budget`` (and ``topk``); ``extra`` arguments go last."""
    args = [
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(draft),
        "--speculative-draft-attention-backend", "torch_native",
    ]
    if budget is not None:
        args += ["--speculative-dflash-tree-budget", str(budget)]
    if topk is not None:
        args += ["--speculative-dflash-tree-topk", str(topk)]
    return args + list(extra)


def tp_args(tp: int) -> tuple[list[str], dict[str, str]]:
    """(server args, env) for tensor parallelism ``tp`` on this CPU machine.

    SGLang binds each TP rank's OpenMP threads to a NUMA node unless told which
    cores to use; a test machine has one node, so rank r gets core r mod cores
    (one thread each: ``server_env``).
    """
    cores = os.cpu_count() or 1
    bind = "|".join(str(rank % cores) for rank in range(tp))
    return ["--tp-size", str(tp)], {"SGLANG_CPU_OMP_THREADS_BIND": bind}


# The target's attention through SGLang's own TritonAttnBackend: its metadata,
# custom_mask / mask_indptr buffers and its real Triton kernels, which the Triton
# interpreter runs on CPU tensors (about 30 ms per kernel program, so only for
# token counts in the tens of steps per request).
TRITON_VERIFY_ARGS = ("--attention-backend", "triton")
TRITON_VERIFY_ENV = {"TRITON_INTERPRET": "1"}


def spawn_server(
    python_dir: Path,
    model: Path,
    args: Sequence[str] = (),
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Server:
    """Start ``sglang.launch_server`` for ``model`` from ``python_dir`` (the
    directory holding ``sglang/``, e.g. from ``prepare_cpu_tree``) and return at
    once; :meth:`Server.wait_healthy` waits for it. ``args`` come after
    :data:`BASE_ARGS` (argparse: the last one wins)."""
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="sglang-cpu-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_server_port(args)
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
        *BASE_ARGS, "--port", str(port), *[str(a) for a in args],
    ]
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=server_env(python_dir, env), start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    server = Server(url=f"http://127.0.0.1:{port}", process=process,
                    log_path=log_path, command=command)
    _LIVE.add(server)
    return server


def launch_server(
    python_dir: Path,
    model: Path,
    args: Sequence[str] = (),
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 400,
) -> Server:
    """:func:`spawn_server`, then return once healthy.

    Raises :class:`StartupError` (with ``log_tail``) if the process exits or is not
    healthy within ``timeout`` seconds; the process group is stopped then.
    """
    server = spawn_server(python_dir, model, args, log_path, env)
    server.wait_healthy(timeout)
    return server


def _wait_healthy(server: Server, timeout: float) -> None:
    start = time.monotonic()
    while True:
        code = server.process.poll()
        if code is not None:
            raise StartupError(
                f"sglang.launch_server exited with code {code} during start-up "
                f"(log: {server.log_path})", server.log_tail(), code)
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - start > timeout:
            raise StartupError(
                f"sglang.launch_server not healthy after {timeout:.0f} s "
                f"(log: {server.log_path})", server.log_tail())
        time.sleep(0.5)


def start_expect_failure(
    python_dir: Path,
    model: Path,
    args: Sequence[str] = (),
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 400,
) -> str:
    """Start a server that must refuse to start; return its log tail.

    Raises AssertionError (after stopping it) if the server became healthy, and
    :class:`StartupError` if it neither exited nor became healthy in time.
    """
    try:
        server = launch_server(python_dir, model, args, log_path, env, timeout)
    except StartupError as e:
        if e.returncode is None:
            raise
        return e.log_tail
    server.stop()
    raise AssertionError(f"the server started although it should not ({args})")
