"""A launch's units on the host: their files written, their processes started detached and
stopped exactly (each unit leads its own session; its pid is checked by start time, and its
session's members are found in /proc, also after the leader died)."""

import os
import signal
import subprocess
import time

from .common import Fail, now
from .launch_record import start_time, unit_pids


def write_files(directory: str, files: list) -> list:
    """Write (name, text, mode) files into `directory` atomically, each created with its mode (an
    env file, which may hold tokens, is 0600 from its first byte; the umask cannot widen it).
    Returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    written = []
    for name, text, mode in files:
        path = os.path.join(directory, name)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # before any content: exactly `mode`, whatever the umask took away
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
        except BaseException:
            os.unlink(tmp)
            raise
        os.replace(tmp, path)
        written.append(path)
    return written


def unit_files(unit: dict) -> list:
    """A unit's script (0755) and env file (0600), as write_files takes them."""
    return [(unit["script_file"], unit["script"], 0o755), (unit["env_file"], unit["env"], 0o600)]


def start_unit(remote: str, unit: dict) -> dict:
    """Start the unit's script detached in its own session (it leads its own process group, which
    stop signals); the record of what started."""
    log = os.path.join(remote, unit["name"] + ".log")
    with open(log, "a") as fh:
        fh.write("=== ddeploy launch %s at %s ===\n" % (unit["script_file"], now()))
        fh.flush()
        proc = subprocess.Popen(
            ["nohup", "bash", "./" + unit["script_file"]],
            cwd=remote,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started = start_time(proc.pid)
    if started is None:
        raise Fail("RemoteCommandError", "%s did not start (exited at once); see %s" % (unit["script_file"], log))
    return {
        "name": unit["name"],
        "script_file": unit["script_file"],
        "pid": proc.pid,
        "starttime": started,
        "log": log,
        "url": unit.get("url"),
    }


def reap(unit: dict) -> None:
    """Reap the unit's leader if this process started it and it exited (a zombie is no member)."""
    try:
        os.waitpid(int(unit["pid"]), os.WNOHANG)
    except ChildProcessError:
        pass


def signal_unit(unit: dict, sig) -> None:
    """`sig` to every live process of the unit's session, its leader gone or not."""
    for pid in unit_pids(unit):
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def remaining(units: list) -> list:
    for u in units:
        reap(u)
    return [u for u in units if unit_pids(u)]


def stop_groups(units: list, grace: float) -> dict:
    """TERM every process of each unit's session (the server's workers too, also those that
    outlived their leader), wait up to `grace` s for all to exit, KILL what is left; {unit name:
    "terminated" | "killed"}."""
    for u in units:
        signal_unit(u, signal.SIGTERM)
    deadline = time.time() + grace
    while remaining(units) and time.time() < deadline:
        time.sleep(0.2)
    outcome = {u["name"]: "terminated" for u in units}
    for u in remaining(units):
        signal_unit(u, signal.SIGKILL)
        outcome[u["name"]] = "killed"
    for _ in range(50):  # KILL cannot be ignored; the kernel needs a moment to take them down
        if not remaining(units):
            break
        time.sleep(0.1)
    return outcome


def signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
