"""A launch's units on the host: their files written, their processes started detached and
stopped exactly (each unit leads its own process group; its pid is checked by start time)."""

import os
import signal
import subprocess
import time

from .common import Fail, now
from .launch_record import start_time


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


def group_alive(unit: dict) -> bool:
    """Whether the unit's process group still has a live member. The group is the recorded one only
    while its leader is (start time checked); after that the group id cannot be reused while any
    member lives, so a remaining member is ours. The leader is reaped first if this process
    started it (a zombie still counts as a member)."""
    pid = int(unit["pid"])
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_groups(units: list, grace: float) -> dict:
    """TERM each unit's process group, wait up to `grace` s for every member (the server's workers
    too) to exit, KILL what is left; {unit name: "terminated" | "killed"}."""
    for u in units:
        signal_group(int(u["pid"]), signal.SIGTERM)
    deadline = time.time() + grace
    while any(group_alive(u) for u in units) and time.time() < deadline:
        time.sleep(0.1)
    outcome = {}
    for u in units:
        outcome[u["name"]] = "terminated"
        if group_alive(u):
            signal_group(int(u["pid"]), signal.SIGKILL)
            outcome[u["name"]] = "killed"
    for _ in range(50):  # KILL cannot be ignored; the kernel needs a moment to take them down
        if not any(group_alive(u) for u in units):
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
