"""`ddeploy log`: the state record's chain of commits, newest first."""

import json

from .common import STATE_REF
from .repo import Repo


def op_log(repo: Repo, req: dict) -> dict:
    if not repo.rev(STATE_REF):
        return {"ok": True, "entries": []}
    raw = repo.out("log", "-%d" % int(req.get("limit", 50)), "--format=%H%x09%cI%x09%s", STATE_REF, "--")
    entries = []
    for line in raw.splitlines():
        commit, date, message = line.split("\t", 2)
        p = repo.run("cat-file", "blob", commit + ":state.json", check=False)
        try:
            last = json.loads(p.stdout.decode()).get("last")
        except ValueError:
            last = None
        entries.append({"commit": commit, "date": date, "message": message, "last": last})
    return {"ok": True, "entries": entries}
