"""A stand-in for SGLang's benchmark client, `python -m sglang.benchmark.serving` (tests only;
see ../../README.md)."""

import argparse
import json
import os
import time
import urllib.request


def told_throughput(name: str, run: int) -> float | None:
    """The output tokens/s STANDIN_CLIENT_TPS gives this config's `run`-th run (from 0, cycling):
    `ddtree=100,120 linear=50` -> ddtree's runs report 100, 120, 100, ...; None: not named."""
    for entry in os.environ.get("STANDIN_CLIENT_TPS", "").split():
        config, _, values = entry.partition("=")
        if config == name:
            series = [float(v) for v in values.split(",")]
            return series[run % len(series)]
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--output-file", required=True)
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--random-output-len", type=int, default=1)
    p.add_argument("--max-concurrency", type=int, default=1)
    args, _ = p.parse_known_args()  # SGLang's other flags, unused here
    with urllib.request.urlopen(args.base_url + "/server_info", timeout=10) as resp:  # noqa: S310 - loopback
        info = json.loads(resp.read())
    algo = info.get("speculative_algorithm")
    name = "plain" if not algo else ("ddtree" if info.get("speculative_dflash_tree_budget") else "linear")
    marks = os.environ["STANDIN_MARKS"]
    earlier = sum(1 for f in os.listdir(marks) if f.startswith("client-%s-" % name))  # this config's runs so far
    with open(os.path.join(marks, "client-%s-%d" % (name, os.getpid())), "w") as fh:
        fh.write(str(os.getpid()))
    start = time.time()
    time.sleep(120.0 if os.environ.get("STANDIN_SLOW") == "client-" + name else 0.2)
    tokens = args.num_prompts * args.random_output_len
    duration = time.time() - start
    told = told_throughput(name, earlier)
    result = {
        "completed": args.num_prompts,
        "duration": duration,
        "total_output_tokens": tokens,
        "output_throughput": told or tokens / duration,
        "median_ttft_ms": 1.0,
        "p99_ttft_ms": 2.0,
        "median_itl_ms": 1000.0 / told if told else 1.0,
        "p99_itl_ms": 2000.0 / told if told else 2.0,
        "accept_length": 2.0 if algo else None,
    }
    with open(args.output_file, "w") as fh:
        fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
