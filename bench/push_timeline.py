"""Where a no-op `ddeploy push` of one host spends its time: a timeline of the real CLI.

    .venv/bin/python bench/push_timeline.py [--reps 9]

Starts one OpenSSH host (tests/sshd_hosts.py), pushes the generated 3-patch set once, then runs
the no-op push --reps times as a subprocess whose first lines wrap a few functions to note when
they start and end (milliseconds since the interpreter started running the command: connect, the
agent's start, the patch set's verification, the agent call). Prints the medians as a table,
beside one `ssh host true` in every round. Asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from sshd_hosts import SshdFleet, build_test_patch_sets  # noqa: E402

from bench_push import byte_compile_ddeploy  # noqa: E402
from deployer.cli.output import table  # noqa: E402

# Runs before the CLI: wrap the steps to time (each note: name, ms since this line ran).
PRELUDE = """
import atexit, json, sys, time
_t0 = time.perf_counter()
_notes = []
def _note(name):
    _notes.append((name, round((time.perf_counter() - _t0) * 1000, 1)))
def _wrap(owner, attr, name):
    inner = getattr(owner, attr)
    def wrapped(*a, **k):
        _note(name + " start")
        try:
            return inner(*a, **k)
        finally:
            _note(name + " end")
    setattr(owner, attr, wrapped)
import deployer.patchset, deployer.transport.connection as c
_wrap(c.SSHConnection, "_open", "connect")
_wrap(c.SSHConnection, "start", "agent start")
_wrap(c._StartedChannel, "finish", "agent call")
_wrap(deployer.patchset, "load_patch_set", "verify set")
atexit.register(lambda: (_note("exit"), sys.stderr.write("TIMELINE " + json.dumps(_notes) + "\\n")))
from deployer.cli import main
main()
"""

ROWS = [
    ("imports, inventory, host selection", None, "connect start"),
    ("paramiko connect (handshake, auth)", "connect start", "connect end"),
    ("patch set loaded and verified (beside the connect)", "verify set start", "verify set end"),
    ("agent started (session, exec)", "agent start start", "agent start end"),
    ("agent call: request sent, reply back (login shell, agent)", "agent call start", "agent call end"),
    ("reply rendered, exit", "agent call end", "exit"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    byte_compile_ddeploy()
    with tempfile.TemporaryDirectory(prefix="ddeploy-timeline-") as tmp:
        env = {**os.environ, "DDEPLOY_CACHE_DIR": str(Path(tmp) / "cache")}
        real_base = Path.home() / ".cache" / "ddeploy" / "base"
        if real_base.is_dir():
            (Path(tmp) / "cache").mkdir()
            (Path(tmp) / "cache" / "base").symlink_to(real_base)  # read-only use of the built base
        os.environ["DDEPLOY_CACHE_DIR"] = env["DDEPLOY_CACHE_DIR"]
        set_dir = build_test_patch_sets(Path(tmp) / "sets")["v2"]
        fleet = SshdFleet.start(Path(tmp) / "hosts", count=1, first_octet=35, prefix="t")
        try:
            host = fleet.hosts[0]
            argv = ["-i", str(fleet.inventory_dir), "push", "--version", str(set_dir), "--host", host.name]
            first = subprocess.run([sys.executable, "-c", PRELUDE, *argv], capture_output=True, text=True, env=env)
            if first.returncode != 0:
                raise SystemExit(f"the first push failed:\n{first.stderr[-2000:]}")
            runs, walls, rtts = [], [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                subprocess.run(["ssh", "-F", str(fleet.ssh_config), host.name, "true"], check=True)
                rtts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-c", PRELUDE, *argv], capture_output=True, text=True, env=env)
                walls.append(time.perf_counter() - t0)
                if proc.returncode != 0 or "already applied" not in proc.stderr:
                    raise SystemExit(f"the no-op push failed:\n{proc.stderr[-2000:]}")
                line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("TIMELINE "))
                runs.append(dict(json.loads(line.removeprefix("TIMELINE "))))
        finally:
            fleet.close()
    rows = []
    for label, start, end in ROWS:
        begins = [r.get(start, 0.0) if start else 0.0 for r in runs]
        spans = [r[end] - b for r, b in zip(runs, begins, strict=True)]
        rows.append([label, f"{statistics.median(begins):.0f}", f"{statistics.median(spans):.0f}"])
    wall, rtt = statistics.median(walls), statistics.median(rtts)
    outside = statistics.median(w * 1000 - r["exit"] for w, r in zip(walls, runs, strict=True))
    rows.append(["interpreter start-up and teardown (wall minus the rest)", "", f"{outside:.0f}"])
    print(f"no-op push of one host, medians of {args.reps}: {wall:.3f} s wall (process start to exit); ", end="")
    print(f"one `ssh host true`: {rtt:.3f} s; ratio {wall / rtt:.2f}x")
    print(f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(table(rows, ["step (ms from the start of the command)", "at", "took"]))


if __name__ == "__main__":
    main()
