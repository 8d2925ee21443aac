"""`ddeploy status` (the checkout's facts, optionally a set's base gate) and the state record
alone (`state`, which launch reads)."""

import os

from .base_gate import check_base
from .facts import facts
from .repo import Repo
from .state import read_state


def op_status(repo: Repo, req: dict) -> dict:
    f = facts(repo)
    expect = req.get("expect")  # a set's preimages: do the touched files at the base match them?
    if expect:
        pre = (f["state"].get("pre_deploy") or {}).get("commit") or f["head"]
        f["base"] = check_base(repo, pre, expect["preimages"], expect)
    return {"ok": True, "facts": f}


def op_state(repo: Repo, req: dict) -> dict:
    """The state record alone (launch reads its kernel builds); empty when nothing was ever deployed."""
    if not os.path.isdir(repo.gitdir):
        return {"ok": True, "state": {"schema": 1, "applied": None, "pre_deploy": None}}
    return {"ok": True, "state": read_state(repo)[1]}
