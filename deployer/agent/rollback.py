"""`ddeploy rollback`: back to the pre-deploy commit or a version applied before, as one
journaled transaction under the checkout's lock."""

import json

from .bytecode import contents, drop_changed
from .common import PRE_REF, STATE_REF, Fail, now, progress
from .facts import head_facts
from .lock import acquire, release
from .plan import describe_drift, in_the_way
from .repo import Repo
from .transaction import recover, save_edits, transact


def op_rollback(repo: Repo, req: dict) -> dict:
    opts = req.get("options", {})
    acquire(repo, req)
    try:
        recovered = recover(repo)
        f = head_facts(repo)
        state = f["state"]
        applied = state.get("applied")
        if not applied:
            return {
                "ok": True,
                "changed": False,
                "recovered": recovered,
                "message": "nothing is applied; nothing to roll back",
            }
        pre = state["pre_deploy"]
        to = opts.get("to")
        if to == applied["version"]:
            return {"ok": True, "changed": False, "message": "%s is already applied" % to}
        target = pre["commit"]
        if to:
            target = repo.rev("refs/ddeploy/versions/%s^{commit}" % to)
            if not target or repo.run("merge-base", "--is-ancestor", pre["commit"], target, check=False).returncode:
                known = [
                    r.rsplit("/", 1)[1]
                    for r in repo.out("for-each-ref", "--format=%(refname)", "refs/ddeploy/versions").split()
                ]
                raise Fail(
                    "StateError",
                    "version %s was never applied on %s (known: %s)" % (to, repo.path, ", ".join(known) or "none"),
                )
        switched = repo.diff_names(f["head"], target)
        relevant = set(applied["files"]) | set(switched)
        blocking = in_the_way(repo, f["head"], switched)
        drift = sorted(set(repo.dirty(relevant)) | set(blocking))
        if f["head"] != applied["head"]:
            drift.insert(0, "HEAD moved since %s was applied" % applied["version"])
        if drift and not opts.get("force"):
            raise Fail(
                "DriftError",
                "%s: %s; rerun with --force to save them (recoverable) and "
                "roll back; nothing was changed" % (repo.path, describe_drift(drift, blocking)),
            )
        saved = save_edits(repo, drift, req, "rollback") if drift else None
        return _rollback_apply(repo, req, f, target, to, saved, recovered)
    finally:
        release(repo)


def _rollback_apply(repo, req, f, target, to, saved, recovered) -> dict:
    state = f["state"]
    applied, pre = state["applied"], state["pre_deploy"]
    engine = {
        "last": {
            "action": "rollback",
            "version": to,
            "from": applied["version"],
            "by": req.get("by"),
            "at": now(),
            "saved": saved,
        }
    }
    if to:
        _c, older = _find_applied(repo, to, pre["commit"])
        engine["applied"] = dict(older, at=now(), by=req.get("by"))
        refs = {}
    else:
        engine.update({"applied": None, "pre_deploy": None})
        refs = {PRE_REF: None}
    message = "rollback %s -> %s by %s" % (applied["version"], to or "pre-deploy", req.get("by"))
    progress("rolling back %s to %s" % (applied["version"], to or "the pre-deploy state %s" % pre["commit"][:12]))
    before = contents(repo, set(applied["files"]) | set((engine.get("applied") or {}).get("files", [])))
    transact(
        repo,
        req,
        "rollback",
        target,
        repo.rev("HEAD^{commit}"),
        applied["files"],
        engine,
        refs,
        message,
        pre.get("branch"),
    )
    drop_changed(repo, before)
    return {
        "ok": True,
        "changed": True,
        "from": applied["version"],
        "to": to,
        "head": target,
        "tree": repo.rev(target + "^{tree}"),
        "saved": saved,
        "recovered": recovered,
    }


def _find_applied(repo: Repo, version: str, pre: str):
    """The newest state record in which `version` was applied on this pre-deploy commit."""
    for line in repo.out("log", "--format=%H", STATE_REF, "--").split():
        p = repo.run("cat-file", "blob", line + ":state.json", check=False)
        try:
            applied = json.loads(p.stdout.decode()).get("applied")
        except ValueError:
            continue
        if (
            applied
            and applied["version"] == version
            and repo.run("merge-base", "--is-ancestor", pre, applied["head"], check=False).returncode == 0
        ):
            return line, applied
    raise Fail("StateError", "no record of %s being applied in %s" % (version, STATE_REF))
