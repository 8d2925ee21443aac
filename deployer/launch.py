"""Start, tail and stop rendered launch scripts on a host.

Layout on the host (launch_dir is a render value, default `<checkout>/../ddeploy-launch`):
    <launch_dir>/<topology>/<unit>.sh, <unit>.env, <unit>.log
    <launch_dir>/launch.json   the last launch: topology, units (pid, start time, log), state
Each unit starts detached (setsid + nohup, stdin /dev/null), so it leads its own process group.
Stop checks the recorded start time (/proc/<pid>/stat field 22) before signalling, so a reused pid
is never hit, then sends TERM to the group, waits, and KILLs what is left.
"""

from __future__ import annotations

import json
import posixpath
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .connection import Connection, open_connection
from .errors import RemoteCommandError, StateError
from .inventory import Host
from .render import RenderedUnit, write_units
from .state import read_state

RECORD = "launch.json"

# $1 dir, $2 script, $3 log. Prints "<pid> <starttime>". A non-interactive sh puts `&` jobs in its
# own process group, so setsid execs in place (no fork) and $! is the server's pid.
START_SH = r'''
cd "$1" || exit 1
printf '=== ddeploy launch %s at %s ===\n' "$2" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$3"
setsid nohup bash "./$2" < /dev/null >> "$3" 2>&1 &
pid=$!
stat=$(cat "/proc/$pid/stat" 2>/dev/null) || { echo "exited at once" >&2; exit 1; }
set -- ${stat##*) }
echo "$pid ${20}"
'''

# Shared by the scripts below: alive PID START succeeds iff PID runs (not a zombie) and its start
# time (field 22 of /proc/PID/stat; the command name in field 2 may hold spaces) is START.
ALIVE_FN = r"""
alive() {
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  want=$2
  set -- ${stat##*) }
  [ "$1" != Z ] && [ "${20}" = "$want" ]
}
"""

# Args: PID START pairs. Prints the pids still running.
ALIVE_SH = ALIVE_FN + r"""
while [ $# -ge 2 ]; do alive "$1" "$2" && echo "$1"; shift 2; done
"""

# Args: GRACE then PID START pairs. TERM each group at once, wait up to GRACE seconds for all,
# KILL the rest. Prints "PID terminated|killed" per pair.
STOP_SH = ALIVE_FN + r"""
grace=$1; shift
pairs="$*"
set -- $pairs
while [ $# -ge 2 ]; do
  alive "$1" "$2" && { kill -s TERM -- "-$1" 2>/dev/null || kill -s TERM "$1"; }
  shift 2
done
n=0
while [ "$n" -lt $((grace * 10)) ]; do
  set -- $pairs; any=
  while [ $# -ge 2 ]; do alive "$1" "$2" && any=1; shift 2; done
  [ -z "$any" ] && break
  sleep 0.1; n=$((n + 1))
done
set -- $pairs
while [ $# -ge 2 ]; do
  if alive "$1" "$2"; then kill -s KILL -- "-$1" 2>/dev/null || kill -s KILL "$1"; echo "$1 killed"
  else echo "$1 terminated"; fi
  shift 2
done
"""


@dataclass(frozen=True)
class Started:
    name: str
    pid: int
    starttime: str
    log: str


def launch_dir(units: list[RenderedUnit]) -> str:
    return dict((v.key, v.value) for v in units[0].values)["launch_dir"]


def _record_path(base: str) -> str:
    return posixpath.join(base, RECORD)


def read_record(conn: Connection, base: str) -> dict | None:
    res = conn.run(["cat", _record_path(base)], check=False)
    if res.rc != 0:
        return None
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError:
        raise StateError(f"{_record_path(base)} is not valid JSON; remove it after checking nothing runs",
                         host=conn.name) from None


def _write_record(conn: Connection, base: str, record: dict) -> None:
    conn.run(["sh", "-c", 'cat > "$1.tmp" && mv "$1.tmp" "$1"', "ddeploy", _record_path(base)],
             input=json.dumps(record, indent=2).encode())


def _pairs(units: list[dict]) -> list[str]:
    return [w for u in units for w in (str(u["pid"]), str(u["starttime"]))]


def alive_units(conn: Connection, record: dict) -> list[dict]:
    """The recorded units whose pid still runs with the recorded start time."""
    units = record.get("units", [])
    if not units:
        return []
    res = conn.run(["sh", "-c", ALIVE_SH, "ddeploy", *_pairs(units)])
    running = set(res.stdout.split())
    return [u for u in units if str(u["pid"]) in running]


def build_cache_dir(state: dict, arch: str) -> tuple[str | None, str]:
    """The JIT cache of a good build of the applied version for `arch`, or (None, why not)."""
    applied = (state.get("applied") or {}).get("version")
    build = (state.get("builds") or {}).get(arch) or {}
    if applied is None:
        return None, "no patch set applied"
    candidates = ([build] if build.get("ok") else []) + list((build.get("known") or {}).values())
    for cand in candidates:
        if cand.get("cache_dir") and cand.get("version") == applied:
            return cand["cache_dir"], f"build record {arch}, {cand.get('at', '?')}"
    if not build:
        return None, f"no kernel build recorded for {arch}"
    return None, f"no good kernel build of the applied version {applied} for {arch}"


def probe_hosts(hosts: list[Host], say: Callable[[str, str], None]) -> dict[str, tuple[dict, str]]:
    """Per host, render values read from the host: jit_cache_dir from its kernel build record."""
    probed = {}
    for host in hosts:
        with open_connection(host) as conn:
            cache_dir, why = build_cache_dir(read_state(conn, host), host.gpu.arch)
        if cache_dir:
            probed[host.name] = ({"jit_cache_dir": cache_dir}, f"host {host.name} {why}")
        else:
            say(f"{why}: JIT kernels will compile at first use (run `ddeploy build --host {host.name}`)", host.name)
    return probed


def _upload(conn: Connection, units: list[RenderedUnit], remote: str) -> None:
    with tempfile.TemporaryDirectory(prefix="ddeploy-launch-") as tmp:
        write_units(units, Path(tmp))
        conn.rsync_to(tmp + "/", remote + "/")


def _start(conn: Connection, remote: str, unit: RenderedUnit) -> Started:
    log = posixpath.join(remote, f"{unit.name}.log")
    res = conn.run(["sh", "-c", START_SH, "ddeploy", remote, unit.script_file, log], check=False)
    if res.rc != 0:
        raise RemoteCommandError(f"{unit.script_file} did not start ({res.stderr.strip() or res.rc}); see {log}",
                                 host=conn.name)
    pid, starttime = res.stdout.split()
    return Started(unit.name, int(pid), starttime, log)


def _tail(conn: Connection, log: str, lines: int = 5) -> str:
    return conn.run(["tail", "-n", str(lines), log], check=False).stdout.strip().replace("\n", " | ")


def launch_host(host: Host, units: list[RenderedUnit], say: Callable[[str], None], settle: float = 1.0) -> dict:
    """Copy the host's units, start each detached, record pids; refuse if a recorded launch still runs."""
    base = launch_dir(units)
    remote = posixpath.join(base, units[0].topology)
    with open_connection(host) as conn:
        previous = read_record(conn, base)
        running = alive_units(conn, previous) if previous else []
        if running:
            pids = ", ".join(str(u["pid"]) for u in running)
            raise StateError(f"topology {previous['topology']} is still running (pid {pids}); "
                             f"run `ddeploy stop --host {host.name}` first", host=host.name)
        _upload(conn, units, remote)
        record = {"topology": units[0].topology, "dir": remote, "state": "running",
                  "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "units": []}
        try:
            for unit in units:
                s = _start(conn, remote, unit)
                record["units"].append(asdict(s))
                say(f"started {s.name} (pid {s.pid}), log {s.log}")
        finally:  # whatever started is recorded, so `stop` can find it even if a later unit failed
            _write_record(conn, base, record)
        time.sleep(settle)  # a script that fails at once (bad python, bad flag) shows it here
        dead = [u for u in record["units"] if u not in alive_units(conn, record)]
        if dead:
            raise RemoteCommandError(f"{dead[0]['name']} exited right after start: {_tail(conn, dead[0]['log'])}",
                                     host=host.name)
        return record


def logs(host: Host, base: str, lines: int, follow: bool, out: Callable[[str], None]) -> None:
    with open_connection(host) as conn:
        record = read_record(conn, base)
        if record is None:
            raise StateError(f"nothing was launched here (no {_record_path(base)}); run `ddeploy launch` first",
                             host=host.name)
        files = [u["log"] for u in record["units"]]
        if not follow:
            res = conn.run(["tail", "-n", str(lines), *files], check=False)
            for line in res.stdout.splitlines():
                out(line)
            return
        # Connections stream stderr line by line, so follow through it. --pid ends the follow (and the
        # remote tail) when the server exits; without a running server it runs until interrupted.
        running = alive_units(conn, record)
        pid = [f"--pid={running[0]['pid']}"] if running else []
        conn.run(["sh", "-c", 'exec tail "$@" >&2', "ddeploy", "-n", str(lines), "-F", *pid, *files],
                 stream=out, check=False)


def stop(host: Host, base: str, say: Callable[[str], None], grace: float = 30.0) -> dict:
    """Stop exactly the processes the last launch recorded (verified by start time)."""
    with open_connection(host) as conn:
        record = read_record(conn, base)
        running = alive_units(conn, record) if record else []
        if not running:
            if record is None:
                what = f"no launch recorded in {_record_path(base)}"
            elif record.get("state") == "stopped":
                what = f"last launch {record['topology']} was stopped at {record.get('stopped_at', '?')}"
            else:
                what = f"last launch {record['topology']} has exited (see `ddeploy logs --host {host.name}`)"
            raise StateError(f"nothing to stop: {what}", host=host.name)
        res = conn.run(["sh", "-c", STOP_SH, "ddeploy", str(max(1, int(grace))), *_pairs(running)],
                       timeout=grace + 60)
        outcome = dict(line.split(None, 1) for line in res.stdout.splitlines() if line.strip())
        for unit in running:
            say(f"{unit['name']} (pid {unit['pid']}): {outcome.get(str(unit['pid']), 'unknown')}")
        record["state"] = "stopped"
        record["stopped_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _write_record(conn, base, record)
        return record
