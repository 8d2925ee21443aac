"""A stand-in for `python -m sglang.launch_server` (tests only; see README.md)."""

import argparse
import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


# The output token at which a config that STANDIN_DIVERGE names differs from the others.
DIVERGE_AT = 3


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", default="stand-in")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-dflash-tree-budget", type=int, default=None)
    p.add_argument("--speculative-dflash-tree-topk", type=int, default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--enable-metrics", action="store_true")
    args, _ = p.parse_known_args()  # the launch script's other flags are SGLang's, unused here
    return args


def config(args: argparse.Namespace) -> str:
    if not args.speculative_algorithm:
        return "plain"
    return "ddtree" if args.speculative_dflash_tree_budget else "linear"


def release_file(name: str):
    """The text of `sglang/<name>` in the SGLang tree the server imports from (the first entry of
    PYTHONPATH that has it: the launch script puts `<checkout>/python` there), None without one: a
    release changes the stand-in's answers as a broken release would change a real server's."""
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        path = os.path.join(entry, "sglang", name)
        if os.path.isfile(path):
            with open(path) as fh:
                return fh.read().strip()
    return None


class InFlight:
    """How many /generate requests the server is answering now (its `num_running_reqs`)."""

    def __init__(self) -> None:
        self.count, self.lock = 0, threading.Lock()

    def __enter__(self) -> None:
        with self.lock:
            self.count += 1

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.count -= 1


def mark(kind: str, name: str) -> int:
    """Write this process's marker; how many markers of `kind`-`name` there were before."""
    marks = os.environ["STANDIN_MARKS"]
    before = sum(1 for f in os.listdir(marks) if f.startswith("%s-%s-" % (kind, name)))
    with open(os.path.join(marks, "%s-%s-%d" % (kind, name, os.getpid())), "w") as fh:
        fh.write(str(os.getpid()))
    return before


def main() -> None:
    args = parse()
    name = config(args)
    earlier = mark("server", name)
    slow = os.environ.get("STANDIN_SLOW", "")
    if str(args.port) == os.environ.get("STANDIN_EXIT_PORT"):
        raise SystemExit("stand-in server: told to exit at start on port %d" % args.port)
    failing = os.environ.get("STANDIN_FAIL", "").split()
    if "server-" + name in failing or (earlier and "server-%s-again" % name in failing):
        raise SystemExit("stand-in server (%s): told to exit at start" % name)
    long = float(os.environ.get("STANDIN_DELAY", "6"))
    delay = long if slow == "server-" + name or (slow == "server-%s-again" % name and earlier) else 0.0
    ready_at = time.time() + delay
    info = {
        "model_path": args.model_path,
        "served_model_name": args.served_model_name or args.model_path,
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_dflash_tree_budget": args.speculative_dflash_tree_budget,
        "speculative_dflash_tree_topk": args.speculative_dflash_tree_topk,
        "speculative_num_draft_tokens": (args.speculative_dflash_tree_budget or 0) + 1,
        "attention_backend": args.attention_backend,
        "tp_size": args.tp_size,
        "ep_size": args.ep_size,
        "version": "0.5.23",
    }
    verified = [0]
    in_flight = InFlight()
    told = name in os.environ.get("STANDIN_DIVERGE", "").split()
    diverges = told or release_file("standin_diverge") is not None
    accept = float(release_file("standin_accept") or 1.0)  # tokens per verify step
    unhealthy = name in os.environ.get("STANDIN_UNHEALTHY", "").split()

    class Handler(BaseHTTPRequestHandler):
        def reply(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200 if time.time() >= ready_at else 503, b"")
            elif self.path == "/health_generate":
                self.reply(200 if time.time() >= ready_at and not unhealthy else 503, b"")
            elif self.path == "/server_info":
                self.reply(200, json.dumps(info).encode())
            elif self.path == "/metrics" and args.enable_metrics:  # SGLang serves it only then
                text = 'sglang:spec_verify_calls_total{model_name="x"} %d\n' % verified[0]
                text += 'sglang:num_running_reqs{model_name="x"} %d\n' % in_flight.count
                text += 'sglang:num_queue_reqs{model_name="x"} 0\n'
                self.reply(200, text.encode(), "text/plain")
            else:
                self.reply(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/generate":
                self.reply(200, b"{}")
                return
            with in_flight:
                self.generate(body)

        def generate(self, body: dict) -> None:
            if name in os.environ.get("STANDIN_SLOW_GENERATE", "").split():
                time.sleep(60)  # a server that stalls: bench's deadline must bound its greedy probes
            n = int(body.get("sampling_params", {}).get("max_new_tokens", 1))
            ids = [(sum(body.get("input_ids", [])) + i) % 1000 for i in range(n)]
            if diverges and n > DIVERGE_AT:  # a wrong verify: one token off, as a broken tree's
                ids[DIVERGE_AT] = (ids[DIVERGE_AT] + 1) % 1000
            steps = math.ceil(n / accept)
            verified[0] += steps
            verify_ct = steps if args.speculative_algorithm else 0
            meta = {"completion_tokens": n, "spec_verify_ct": verify_ct}
            self.reply(200, json.dumps({"output_ids": ids, "meta_info": meta}).encode())

        def log_message(self, *a) -> None:
            pass

    print("stand-in server (%s) on port %d" % (name, args.port), flush=True)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
