"""`ddeploy status` (the checkout's facts, optionally a set's base gate, and the host's last
launch) and the state record alone (`state`, which launch reads)."""

import os

from .base_gate import check_base
from .common import Fail
from .facts import facts
from .launch_record import alive_units, read_launch
from .repo import Repo
from .state import read_state


def launch_summary():
    """The host's last launch as status shows it (None: nothing was launched); read without its
    lock, so a launch or stop at work shows as recorded so far."""
    try:
        record = read_launch()
    except Fail as exc:
        return {"error": str(exc)}
    if record is None:
        return None
    keys = ("id", "topology", "state", "variant", "started_at", "stopped_at", "failure")
    return dict({k: record.get(k) for k in keys}, units=len(record.get("units", [])), alive=len(alive_units(record)))


def op_status(repo: Repo, req: dict) -> dict:
    f = facts(repo)
    expect = req.get("expect")  # a set's preimages: do the touched files at the base match them?
    if expect:
        pre = (f["state"].get("pre_deploy") or {}).get("commit") or f["head"]
        f["base"] = check_base(repo, pre, expect["preimages"], expect)
    f["launch"] = launch_summary()
    return {"ok": True, "facts": f}


def op_state(repo: Repo, req: dict) -> dict:
    """The state record alone (launch reads its kernel builds); empty when nothing was ever deployed."""
    if not os.path.isdir(repo.gitdir):
        return {"ok": True, "state": {"schema": 1, "applied": None, "pre_deploy": None}}
    return {"ok": True, "state": read_state(repo)[1]}
