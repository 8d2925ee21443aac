"""Benchmark: the overlay developer's loop, ddeploy against doing it by hand.

    .venv/bin/python bench/dev_loop.py [--reps 5] [-k ddtree_utils] [--file PATH_IN_THE_OVERLAY] [--checkout]

Starts one OpenSSH host whose python imports SGLang from its checkout (tests/host_env.py) and
copies the overlay (overlays/ddtree, read only) to a scratch directory. Each round makes a
one-line edit to --file in that copy (a comment with the round's number), then, alternately:
  * ddeploy: `ddeploy test --remote --host k1 --overlay COPY -k EXPR` (the dev snapshot: the
    overlay's checks, the push of the changed set, pytest on the host, the report back), over the
    connection the first round kept (ddeploy's default; control.py);
  * by hand: `scp` of the edited file into a second checkout on the same host (a copy of the
    first, made after ddeploy's first push, so it holds the same tree), then `ssh host pytest`
    with the same python, the same tests and the same -k.
Prints the median of each, the pass counts pytest reported in each loop (and a warning when they
differ: then the loops did not run the same tests) and ddeploy's overhead in seconds. ddeploy
runs as a user installs it (bench_push.install_ddeploy; --checkout: from this checkout's .venv).
Asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from host_env import start_python_fleet  # noqa: E402

from bench_push import add_checkout_option, install_ddeploy  # noqa: E402
from deployer.agent.overlay_tests import TEST_DIR  # noqa: E402

SUMMARY = re.compile(r"(\d+) passed")
seen: dict[str, set[str]] = {"ddeploy": set(), "by hand": set()}  # pytest's summaries, to compare


def timed(argv: list[str], env: dict[str, str], who: str | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if who is not None:
        seen[who].update(m.group(0) for m in SUMMARY.finditer(proc.stdout + proc.stderr))
    return took


class Loop:
    def __init__(self, fleet, overlay: Path, file: str, expr: str, env: dict[str, str], ddeploy: list[str]):
        self.fleet, self.overlay, self.file, self.expr, self.env = fleet, overlay, file, expr, env
        self.command = ddeploy
        self.host = fleet.hosts[0]
        self.by_hand = self.host.root / "by-hand"  # the second checkout the by-hand loop edits
        self.python = self.host.root / "venv" / "bin" / "python"

    def edit(self, n: int) -> None:
        path = self.overlay / self.file
        text = path.read_text().rstrip("\n").split("\n# dev-loop edit")[0]
        path.write_text(f"{text}\n# dev-loop edit {n}\n")

    def ddeploy(self) -> float:
        args = ["test", "--remote", "--host", self.host.name, "--overlay", str(self.overlay), "-k", self.expr]
        return timed([*self.command, "-i", str(self.fleet.inventory_dir), *args], self.env, "ddeploy")

    def ssh(self, *words: str) -> list[str]:
        return ["ssh", "-F", str(self.fleet.ssh_config), self.host.name, shlex.join(words)]

    def copy_checkout(self) -> None:
        shutil.copytree(self.host.checkout, self.by_hand, symlinks=True)

    def by_hand_loop(self) -> float:
        t0 = time.perf_counter()
        scp = ["scp", "-q", "-F", str(self.fleet.ssh_config), str(self.overlay / self.file)]
        timed([*scp, f"{self.host.name}:{self.by_hand / self.file}"], self.env)
        pytest = [str(self.python), "-m", "pytest", TEST_DIR, "-q", "-p", "no:cacheprovider", "-k", self.expr]
        run = ["env", f"PYTHONPATH={self.by_hand / 'python'}", *pytest]
        timed(self.ssh("sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", str(self.by_hand), *run), self.env, "by hand")
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-k", dest="expr", default="ddtree_utils")
    ap.add_argument("--file", default="python/sglang/srt/speculative/ddtree_utils.py")
    add_checkout_option(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddeploy-devloop-") as tmp:
        _, ddeploy = install_ddeploy(Path(tmp), args.checkout)
        cache = Path(tmp) / "cache"
        cache.mkdir()
        real_base = Path.home() / ".cache" / "ddeploy" / "base"
        if real_base.is_dir():
            (cache / "base").symlink_to(real_base)  # read-only use of the built base
        os.environ["DDEPLOY_CACHE_DIR"] = str(cache)
        os.environ["DDEPLOY_CONTROL_DIR"] = str(Path(tmp) / "control")  # the bench's own kept connections
        env = dict(os.environ)
        overlay = Path(tmp) / "overlay"
        shutil.copytree(ROOT / "overlays" / "ddtree", overlay, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        fleet = start_python_fleet(Path(tmp) / "hosts", count=1)
        try:
            loop = Loop(fleet, overlay, args.file, args.expr, env, ddeploy)
            loop.edit(0)
            loop.ddeploy()  # the first push of the overlay: not part of the loop
            loop.copy_checkout()
            loop.by_hand_loop()  # warm the by-hand side the same way
            runs: dict[str, list[float]] = {"ddeploy": [], "by hand": []}
            for n in range(1, args.reps + 1):
                loop.edit(n)
                runs["ddeploy"].append(loop.ddeploy())
                runs["by hand"].append(loop.by_hand_loop())
        finally:
            from deployer.transport.control import disconnect

            disconnect()
            fleet.close()
    hand, tool = statistics.median(runs["by hand"]), statistics.median(runs["ddeploy"])
    print(f"dev loop: a one-line edit of {args.file}, then the tests -k {args.expr}; medians of {args.reps}")
    print(f"  by hand (scp + ssh pytest): {hand:.2f} s ({', '.join(sorted(seen['by hand']))})")
    print(f"  ddeploy test --remote --overlay: {tool:.2f} s ({', '.join(sorted(seen['ddeploy']))})")
    print(f"  ddeploy's overhead: {tool - hand:+.2f} s")
    if seen["ddeploy"] != seen["by hand"]:  # the comparison only holds for the same tests
        print(f"  NOT THE SAME TESTS: ddeploy {sorted(seen['ddeploy'])}, by hand {sorted(seen['by hand'])}")
    print(f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
