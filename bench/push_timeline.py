"""Where a `ddeploy push` of one host spends its time (no-op and first): a timeline of the real CLI.

    .venv/bin/python bench/push_timeline.py [--reps 9] [--rtt-ms 30] [--checkout] [--baseline REV]

Starts one OpenSSH host (tests/sshd_hosts.py), pushes the generated 3-patch set once, then runs
the no-op push --reps times as a subprocess whose first lines wrap a few functions to note when
they start and end (milliseconds since the interpreter started running the command: the connect,
the agent's start, the client ready to send its request, the agent call), in two modes: `kept`
(ddeploy's default: the connection the first push kept, control.py) and `own`
(DDEPLOY_CONTROL_PERSIST=0: each push connects). Each round ends with a first push, as
bench_push times one (no kept connection, the checkout reset, the set not yet shipped): the
connection master's start and connect, then the agent's start on the new connection; with
--baseline, the same first push of that git revision right after it in every round (each in a
venv of its own). --rtt-ms puts bench_push's delaying proxy (a link with that round trip)
between the client and the host; 0, the default, is loopback. Prints the medians as tables,
beside one `ssh host true` in every round.
ddeploy runs as a user installs it (bench_push.install_ddeploy; --checkout: from this
checkout's .venv). Asserts nothing about timing.
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

from bench_push import add_checkout_option, install_ddeploy, reset, through_link  # noqa: E402
from delay_proxy import DelayProxy  # noqa: E402
from deployer.cli.output import table  # noqa: E402

# Runs before the CLI: wrap the steps to time (each note: name, ms since this line ran).
PRELUDE = """
import atexit, json, sys, time
_t0 = time.perf_counter()
_notes = []
def _note(name):
    _notes.append((name, round((time.perf_counter() - _t0) * 1000, 1)))
def _wrap(owner, attr, name):
    inner = getattr(owner, attr, None)
    if inner is None:  # a --baseline revision without it: that step is not noted
        return
    def wrapped(*a, **k):
        _note(name + " start")
        try:
            return inner(*a, **k)
        finally:
            _note(name + " end")
    setattr(owner, attr, wrapped)
import os
import deployer.transport.early_agents as a
if os.environ.get("DDEPLOY_CONTROL_PERSIST") == "0":  # the command's own connection
    import deployer.transport.ssh_connection as c  # paramiko: first anyway
    _wrap(c.SSHConnection, "_open_fresh", "connect")
    _wrap(c.SSHConnection, "start", "agent start")
    _wrap(c._StartedChannel, "finish", "agent call")
else:  # the kept connection: a look at its socket, then commands through it
    import deployer.transport.control as c
    import deployer.transport.master_start as m
    import deployer.transport.shared_connection as s
    _wrap(c.Connector, "__init__", "connect")
    _wrap(s.SharedConnection, "start", "agent start")
    _wrap(s._SharedCommand, "finish", "agent call")
    _wrap(m.MasterStart, "wait", "master")  # a first push: until the master it started has connected
_wrap(a.EarlyAgents, "start", "client ready")
atexit.register(lambda: (_note("exit"), sys.stderr.write("TIMELINE " + json.dumps(_notes) + "\\n")))
from deployer.cli import main
main()
"""

ROWS = [
    ("client: imports, inventory, hosts chosen, set verified", None, "client ready start"),
    ("connect: handshake, auth (kept: its socket checked)", "connect start", "connect end"),
    ("agent started: session, exec of the bootstrap (sent)", "agent start start", "agent start end"),
    ("agent call: program and request sent, reply back", "agent call start", "agent call end"),
    ("reply rendered, exit", "agent call end", "exit"),
]
# ddeploy as users run it (the connection the first push kept), and with reuse off.
MODES = {"kept": {}, "own": {"DDEPLOY_CONTROL_PERSIST": "0"}}
# A first push (from closed connections, reset checkouts, a set never shipped), as bench_push
# times it: the client starts the connection master, which connects while the client verifies
# the set; the agent then starts on the new connection (the host's login shell, Python).
FIRST_ROWS = [
    ("client: imports, inventory, hosts chosen", None, "connect start"),
    ("client: the set verified, beside the master", "connect end", "client ready start"),
    ("connection master: its start, imports, handshake, auth", "connect start", "master end"),
    ("agent call: login shell, Python, the push, reply back", "agent call start", "agent call end"),
    ("reply rendered, exit", "agent call end", "exit"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument(
        "--baseline", metavar="REV", help="also time the first push of this git revision, alternately, in the same run"
    )
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="the link's round trip (0: loopback)")
    add_checkout_option(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddeploy-timeline-") as tmp:
        python, _ = install_ddeploy(Path(tmp), args.checkout)
        pythons = {"first": python}
        if args.baseline:
            pythons["baseline"] = install_revision(args.baseline, Path(tmp) / "baseline")
        env = {**os.environ, "DDEPLOY_CACHE_DIR": str(Path(tmp) / "cache")}
        real_base = Path.home() / ".cache" / "ddeploy" / "base"
        if real_base.is_dir():
            (Path(tmp) / "cache").mkdir()
            (Path(tmp) / "cache" / "base").symlink_to(real_base)  # read-only use of the built base
        os.environ["DDEPLOY_CACHE_DIR"] = env["DDEPLOY_CACHE_DIR"]
        env["DDEPLOY_CONTROL_DIR"] = os.environ["DDEPLOY_CONTROL_DIR"] = str(Path(tmp) / "control")
        set_dir = build_test_patch_sets(Path(tmp) / "sets")["v2"]
        fleet = SshdFleet.start(Path(tmp) / "hosts", count=1, first_octet=35, prefix="t")
        link = DelayProxy(args.rtt_ms / 1000) if args.rtt_ms else None
        try:
            view, link_line = through_link(fleet, link, Path(tmp) / "link")
            host = view.hosts[0]
            argv = ["-i", str(view.inventory_dir), "push", "--version", str(set_dir), "--host", host.name]
            # Run from tmp: `python -c` puts the working directory first on sys.path, and this
            # checkout's sources there would shadow the installed ddeploy.
            first = subprocess.run(
                [str(python), "-c", PRELUDE, *argv], capture_output=True, text=True, env=env, cwd=tmp
            )
            if first.returncode != 0:
                raise SystemExit(f"the first push failed:\n{first.stderr[-2000:]}")
            runs: dict[str, list] = {m: [] for m in [*MODES, *pythons]}
            walls: dict[str, list] = {m: [] for m in [*MODES, *pythons]}
            rtts = []

            def timed(mode: str, extra: dict, expect: str) -> None:
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [str(pythons.get(mode, python)), "-c", PRELUDE, *argv],
                    capture_output=True,
                    text=True,
                    env={**env, **extra},
                    cwd=tmp,
                )
                walls[mode].append(time.perf_counter() - t0)
                if proc.returncode != 0 or expect not in proc.stderr:
                    raise SystemExit(f"the {mode} push failed:\n{proc.stderr[-2000:]}")
                line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("TIMELINE "))
                runs[mode].append(dict(json.loads(line.removeprefix("TIMELINE "))))

            for _ in range(args.reps):
                t0 = time.perf_counter()
                subprocess.run(["ssh", "-F", str(view.ssh_config), host.name, "true"], check=True)
                rtts.append(time.perf_counter() - t0)
                for mode, extra in MODES.items():
                    timed(mode, extra, "already applied")
                # The baseline's first push, then this checkout's: its kept connection serves the
                # next round's no-op push.
                for mode in reversed(pythons):
                    reset(fleet, Path(tmp))  # as bench_push before its first push
                    timed(mode, {}, "applied ddtree")
        finally:
            from deployer.transport.control import disconnect

            disconnect()
            if link is not None:
                link.close()
            fleet.close()
    rtt = statistics.median(rtts)
    rows = [[label] for label, _, _ in ROWS] + [["interpreter start-up and teardown (wall minus the rest)"]]
    for mode in MODES:
        for row, (_, start, end) in zip(rows, ROWS, strict=False):
            begins = [r.get(start, 0.0) if start else 0.0 for r in runs[mode]]
            spans = [r[end] - b for r, b in zip(runs[mode], begins, strict=True)]
            row += [f"{statistics.median(begins):.0f}", f"{statistics.median(spans):.0f}"]
        outside = statistics.median(w * 1000 - r["exit"] for w, r in zip(walls[mode], runs[mode], strict=True))
        rows[-1] += ["", f"{outside:.0f}"]
    print(f"no-op push of one host, medians of {args.reps}; one `ssh host true`: {rtt:.3f} s")
    for mode in MODES:
        wall = statistics.median(walls[mode])
        print(f"  {mode}: {wall:.3f} s wall (process start to exit), {wall / rtt:.2f}x the round trip")
    print(link_line)
    print(f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    head = ["step (ms from the start of the command)"]
    for mode in MODES:
        head += [f"{mode}: at", "took"]
    print(table(rows, head))
    print()
    print(f"first push of one host (bench_push's first row), medians of {args.reps}:")
    wall = statistics.median(walls["first"])
    print(f"  {wall:.3f} s wall (process start to exit), {wall / rtt:.2f}x the round trip")
    if args.baseline:
        base = statistics.median(walls["baseline"])
        print(f"  baseline {args.baseline}: {base:.3f} s wall; this checkout takes {wall / base:.2f}x its time")
    rows = [[label] for label, _, _ in FIRST_ROWS]
    for mode in pythons:
        for row, (_, start, end) in zip(rows, FIRST_ROWS, strict=True):
            done = [r for r in runs[mode] if end in r and (start is None or start in r)]
            begins = [r[start] if start else 0.0 for r in done]
            spans = [r[end] - b for r, b in zip(done, begins, strict=True)]
            row += [f"{statistics.median(begins):.0f}", f"{statistics.median(spans):.0f}"] if done else ["", ""]
    head = ["step (ms from the start of the command)", "at", "took"]
    if args.baseline:
        head += ["baseline: at", "took"]
    print(table(rows, head))


def install_revision(rev: str, into: Path) -> Path:
    """ddeploy at git revision `rev` of this checkout, installed as install_ddeploy installs it."""
    source = into / "source"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    python, _ = install_ddeploy(into, source=source)
    return python


if __name__ == "__main__":
    main()
