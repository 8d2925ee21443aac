"""The checkout lock's edges: probes (status, lock status) never refuse a push, a filesystem without
flock support is named as such (never "locked"), and one command holds one lock for all its work."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deployer.agent.common import Fail
from deployer.agent.lock import acquire, holder_path, read_lock, release
from deployer.agent.mounts import mount_of
from deployer.agent.repo import Repo
from sshd_hosts import STUB
from test_remote_safety import cli_process, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _repo(tmp_path: Path) -> Repo:
    (tmp_path / ".git" / "ddeploy").mkdir(parents=True)
    return Repo(str(tmp_path))


PROBER = textwrap.dedent(
    """
    import sys, time
    from deployer.agent.lock import read_lock
    from deployer.agent.repo import Repo
    repo, seen, end = Repo(sys.argv[1]), 0, time.monotonic() + float(sys.argv[2])
    print("probing", flush=True)
    while time.monotonic() < end:
        seen += bool((read_lock(repo) or {}).get("alive"))
    print(seen, flush=True)
    """
)


def test_status_probes_in_a_tight_loop_never_make_a_push_see_the_lock_as_taken(tmp_path):
    """Two real processes: one probes the lock state as fast as it can (what `status` and `lock
    status` do), this one takes and drops the lock as fast as it can (what pushes do). Only probes
    run beside the acquirer, so it must never be told "locked"."""
    repo = _repo(tmp_path)
    prober = subprocess.Popen(
        [sys.executable, "-c", PROBER, repo.path, "4"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert prober.stdout.readline().strip() == "probing"
    refused, rounds, end = [], 0, time.monotonic() + 3
    try:
        while time.monotonic() < end:
            try:
                acquire(repo, {"by": "t@x", "command": "ddeploy push"})
            except Fail as exc:
                refused.append(str(exc))
                continue
            rounds += 1
            release(repo)
    finally:
        seen_held = int(prober.communicate(timeout=30)[0].strip())
    assert refused == [], f"{len(refused)} of {rounds + len(refused)} acquisitions refused: {refused[0]}"
    assert rounds > 100 and seen_held > 0  # both loops really ran, and the probes saw the lock held


def _flock_failing_with(code: int):
    """A stand-in for fcntl.flock that fails as a filesystem without lock support does (this
    machine cannot mount one: only the errno is faked, in this process)."""

    def flock(fd, how):
        raise OSError(code, os.strerror(code))

    return flock


@pytest.mark.parametrize(
    "code,name", [(errno.ENOLCK, "ENOLCK"), (errno.EOPNOTSUPP, "EOPNOTSUPP"), (errno.EINVAL, "EINVAL")]
)
def test_a_filesystem_without_flock_is_named_with_its_mount_never_reported_as_locked(tmp_path, monkeypatch, code, name):
    """Fakes only the flock call's errno (monkeypatched in-process); the mount is this machine's."""
    repo = _repo(tmp_path)
    acquire(repo, {"by": "t@x"})  # a real lock first, so the probe finds the marker to ask
    release(repo)
    fstype, mount_point = mount_of(str(tmp_path))
    monkeypatch.setattr(fcntl, "flock", _flock_failing_with(code))
    for attempt in (lambda: acquire(repo, {"by": "t@x"}), lambda: read_lock(repo)):
        with pytest.raises(Fail) as failed:
            attempt()
        msg = str(failed.value)
        assert failed.value.kind == "StateError" and "locked" not in msg, msg
        assert f"flock failed with {name}" in msg and str(repo.ddir) in msg
        assert f"({fstype}, mounted at {mount_point})" in msg
        assert "lockd" in msg and "-o flock" in msg and "local filesystem" in msg
    assert not Path(holder_path(repo)).exists()


def test_would_block_alone_means_locked(tmp_path, monkeypatch):
    repo = _repo(tmp_path)
    monkeypatch.setattr(fcntl, "flock", _flock_failing_with(errno.EWOULDBLOCK))
    with pytest.raises(Fail) as failed:
        acquire(repo, {"by": "t@x"})
    assert failed.value.kind == "LockError" and "is locked" in str(failed.value)


def test_the_mount_of_a_path_is_the_deepest_and_topmost_one(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        "23 22 0:40 / /srv/my\\040dir rw shared:1 - nfs4 fs:/export rw,vers=4.2\n"
        "24 22 0:41 / /srv/my\\040dir rw - lustre mgs@tcp:/fs rw,flock\n"  # mounted on top of the nfs4
        "25 22 0:42 / /srv/my rw - tmpfs tmpfs rw\n"
    )
    assert mount_of("/srv/my dir/sglang/.git", str(info)) == ("lustre", "/srv/my dir")
    assert mount_of("/srv/my/x", str(info)) == ("tmpfs", "/srv/my")
    assert mount_of("/srv/mydir", str(info)) == ("ext4", "/")
    assert mount_of("/x", str(tmp_path / "absent")) is None


def _applied_version(h) -> str | None:
    p = subprocess.run(
        ["git", "-C", str(h.checkout), "cat-file", "blob", "refs/ddeploy/state:state.json"],
        capture_output=True,
        text=True,
    )
    return ((json.loads(p.stdout) if p.returncode == 0 else {}).get("applied") or {}).get("version")


@pytest.mark.sshd
def test_a_push_started_between_push_builds_phases_is_refused_and_names_it(hosts, ddeploy, patch_sets):
    """`push --build` is one command: once its push phase has applied 0.1.0, a second push (of
    0.2.0) must not get in before its build phase (made long here by the agent's test pause)."""
    h1 = hosts.hosts[0]
    first = cli_process(
        hosts, "push", "--host", "h1", "--version", str(patch_sets["v1"]), "--build", pause="before_build:4"
    )
    try:
        wait_for(lambda: _applied_version(h1) == "0.1.0", what="the push phase to apply 0.1.0")
        second = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v2"]))
        assert second.code == 7, second.stderr
        assert "is locked by" in second.stderr and "push --host h1" in second.stderr and "--build" in second.stderr
        assert (h1.checkout / STUB).read_text() == "VERSION = 1\n" and _applied_version(h1) == "0.1.0"
    finally:
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert "pausing 4.0s before build (test hook)" in err and "kernel sources unchanged by this push" in err
    assert _applied_version(h1) == "0.1.0" and not (h1.checkout / ".git/ddeploy/deploy.lock.json").exists()
