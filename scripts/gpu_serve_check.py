"""The serving part of ``gpu_check.py --serve``: DDTree in a real SGLang server on CUDA.

Uses the overlay harness's tiny models (``test/srt/ddtree/cpu_engine/models.py`` of the
patched checkout) and starts, one after another, on this GPU with the triton backend:

  plain            no speculation (the greedy reference)
  linear           DFlash, CUDA graphs on
  ddtree-graph     DDTree (budget 16), CUDA graphs on
  ddtree-eager     DDTree (budget 16), --disable-cuda-graph

and checks that greedy DDTree (graphs on and off) equals plain decoding token for token,
that a temperature request runs the sampling verify through SGLang's CUDA kernel (the
server log names the implementation), and prints accept length and step time of DDTree
against linear DFlash. Needs SGLang 0.5.23's runtime packages in this python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPTS = [list(range(5, 20)), [30, 31, 32], [7, 9, 11, 13, 17, 19], [50, 12, 50, 12]]
NEW_TOKENS = 64
BUDGET = 16


def _server_args(models, name: str) -> list[str]:
    base = [
        "--device",
        "cuda",
        "--attention-backend",
        "triton",
        "--dtype",
        "float32",
        "--max-running-requests",
        "8",
        "--mem-fraction-static",
        "0.3",
    ]
    if name == "plain":
        return base
    spec = [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(models.draft),
        "--speculative-draft-attention-backend",
        "triton",
    ]
    if name.startswith("ddtree"):
        spec += ["--speculative-dflash-tree-budget", str(BUDGET)]
    if name == "ddtree-eager":
        spec += ["--disable-cuda-graph"]
    return base + spec


def _start(root: Path, models, name: str, log_dir: Path, server_cls):
    from cpu_engine.server import free_port

    port = free_port()
    log_path = log_dir / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(models.target),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--random-seed",
        "0",
        *_server_args(models, name),
    ]
    env = dict(os.environ, PYTHONPATH=str(root / "python"), HF_HUB_OFFLINE="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = server_cls(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, command=command)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name}: server exited; see {log_path}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=10) as r:  # noqa: S310  (http://127.0.0.1)
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    server.stop()
    raise RuntimeError(f"{name}: not healthy after 300 s; see {log_path}")


def serving_check(root: Path, log_dir: Path, log) -> tuple[bool, str]:
    """(all checks passed, the table) for a patched checkout at ``root``."""
    sys.path.insert(0, str(root / "test" / "srt" / "ddtree"))
    from cpu_engine.models import make_tiny_models
    from cpu_engine.server import Server

    log_dir.mkdir(parents=True, exist_ok=True)
    models = make_tiny_models(log_dir / "models", vocab=64)
    outputs, stats, ok = {}, {}, True
    for name in ("plain", "linear", "ddtree-graph", "ddtree-eager"):
        log(f"serve: starting {name}")
        server = _start(root, models, name, log_dir, Server)
        try:
            results = server.generate_batch(PROMPTS, max_new_tokens=NEW_TOKENS)
            outputs[name] = [r["output_ids"] for r in results]
            metas = [r["meta_info"] for r in results]
            if name != "plain":
                stats[name] = (
                    sum(m["spec_accept_length"] for m in metas) / len(metas),
                    1e3 * sum(m["e2e_latency"] / m["spec_verify_ct"] for m in metas) / len(metas),
                )
            if name == "ddtree-graph":
                server.generate(PROMPTS[0], max_new_tokens=16, temperature=0.8)
        finally:
            server.stop()
    for name in ("linear", "ddtree-graph", "ddtree-eager"):
        equal = outputs[name] == outputs["plain"]
        ok &= equal
        log(f"serve: {name} greedy {'equals' if equal else 'DIFFERS FROM'} plain decoding")
    text = (log_dir / "ddtree-graph.log").read_text(errors="replace")
    kernel = "DDTree sampling verify: dense tree speculative sampling (SGLang kernel)"
    ok &= kernel in text
    log(f"serve: sampling verify through SGLang's kernel: {kernel in text}")
    rows = ["| server | accept length | step ms |", "|---|---|---|"]
    rows += [f"| {n} | {a:.2f} | {s:.2f} |" for n, (a, s) in stats.items()]
    return ok, "\n".join(rows)
