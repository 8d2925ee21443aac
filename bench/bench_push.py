"""Benchmark: push one patch set to 1, 4 and 8 real sshd test hosts on loopback.

    .venv/bin/python bench/bench_push.py [--sizes 1,4,8] [--version DIR|V] [--parallel N]

Starts its own OpenSSH hosts (tests/sshd_hosts.py), each with a clone of the pristine base, and
runs the real CLI as a subprocess. For each fleet size: wall time of the first push, mean and max
per-host duration (from --json), and the wall time of a second push of the same version (a no-op).
Prints a table; asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from sshd_hosts import SshdFleet, build_test_patch_sets  # noqa: E402

from deployer.cli.output import table  # noqa: E402


def push(fleet: SshdFleet, names: list[str], version: str, parallel: int) -> tuple[float, list[dict]]:
    args = [
        sys.executable,
        "-c",
        "from deployer.cli import main; main()",
        "-i",
        str(fleet.inventory_dir),
        "push",
        "--version",
        version,
        "--parallel",
        str(parallel),
        "--json",
    ]
    for n in names:
        args += ["--host", n]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"push failed ({proc.returncode}):\n{proc.stderr}")
    return wall, json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--version", help="patch set (version or directory); default: a small generated 3-patch set")
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="ddeploy-bench-") as tmp:
        os.environ.setdefault("DDEPLOY_CACHE_DIR", str(Path(tmp) / "cache"))
        real_base = Path.home() / ".cache" / "ddeploy" / "base"
        if real_base.is_dir() and not (Path(tmp) / "cache" / "base").exists():
            (Path(tmp) / "cache").mkdir()
            (Path(tmp) / "cache" / "base").symlink_to(real_base)  # read-only use of the built base
        version = args.version or str(build_test_patch_sets(Path(tmp) / "sets")["v2"])
        t0 = time.perf_counter()
        fleet = SshdFleet.start(Path(tmp) / "hosts", count=max(sizes), first_octet=31, prefix="b")
        print(
            f"started {max(sizes)} sshd hosts with their checkouts in {time.perf_counter() - t0:.1f}s", file=sys.stderr
        )
        rows = []
        try:
            for n in sizes:
                fleet.reset()
                names = [h.name for h in fleet.hosts[:n]]
                wall, results = push(fleet, names, version, args.parallel)
                per = [r["duration_s"] for r in results]
                assert all(r["changed"] for r in results)
                noop, again = push(fleet, names, version, args.parallel)
                assert not any(r["changed"] for r in again)
                rows.append(
                    [
                        str(n),
                        f"{wall:.2f}",
                        f"{sum(per) / n:.2f}",
                        f"{max(per):.2f}",
                        f"{noop:.2f}",
                        f"{sum(r['duration_s'] for r in again) / n:.2f}",
                    ]
                )
        finally:
            fleet.close()
    print(
        table(
            rows, ["hosts", "push wall s", "per host mean s", "per host max s", "no-op push wall s", "no-op per host s"]
        )
    )


if __name__ == "__main__":
    main()
