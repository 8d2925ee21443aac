"""`ddeploy push`: the set's commits built in a private index, then the journaled switch and
the state commit, under the checkout's lock."""

import os

from .bytecode import contents, drop_changed
from .common import FIXED_DATES, PRE_REF, Fail, now, progress
from .facts import head_facts
from .lock import acquire, release
from .patch_files import Scratch, load_patches
from .plan import apply_error, plan
from .pruning import prune_dev_sets
from .repo import Repo
from .transaction import recover, save_edits, transact


def build_commits(repo: Repo, pre: str, patches: list, spec: dict, three_way: bool) -> tuple:
    """One commit per patch on top of pre, built in a private index: all or nothing. Returns
    ([{name, sha256, commit}], the last commit's tree, None for no patch)."""
    work = os.path.join(repo.ddir, "tmp")
    os.makedirs(work, exist_ok=True)
    env = dict(FIXED_DATES, GIT_INDEX_FILE=os.path.join(work, "index-%d" % os.getpid()))
    try:
        repo.run("read-tree", pre, env=env)
        parent, made, tree = pre, [], None
        for name, path, sha, _files in patches:
            args = ["apply", "--cached"] + (["--3way"] if three_way else []) + [path]
            p = repo.run(*args, env=env, check=False)
            if p.returncode != 0:
                raise Fail(
                    "ConflictError",
                    "patch %s does not apply to %s: %s; nothing was changed%s"
                    % (name, repo.path, apply_error(p.stderr), "" if three_way else " (rerun with --3way to merge)"),
                )
            tree = repo.out("write-tree", env=env)
            msg = "%s %s: %s\n\nsha256: %s\n" % (spec["name"], spec["version"], name, sha)
            parent = repo.out("commit-tree", tree, "-p", parent, "-m", msg, env=env)
            made.append({"name": name, "sha256": sha, "commit": parent})
        return made, tree
    finally:
        try:
            os.unlink(env["GIT_INDEX_FILE"])
        except OSError:
            pass


def op_push(repo: Repo, req: dict) -> dict:
    need_checkout(repo)
    with Scratch("ddeploy-push-") as workdir:
        patches = load_patches(req, workdir)  # NeedShip: the client sends the set in a second call
        acquire(repo, req)
        try:
            return push_held(repo, req, patches)
        finally:
            release(repo)


def need_checkout(repo: Repo) -> None:
    if not os.path.isdir(repo.gitdir):
        raise Fail("StateError", "%s is not a git checkout (no .git directory); clone SGLang there first" % repo.path)


def push_held(repo: Repo, req: dict, patches: list) -> dict:
    """The push proper, by a caller that holds the checkout's lock (op_push, push-build)."""
    spec, opts = req["set"], req.get("options", {})
    recovered = recover(repo)
    f = head_facts(repo)  # plan makes its own drift check, of the files it changes
    # No dry run of the series: the commits are built in a private index before anything else is
    # written, with the same strict apply, so a patch that does not apply fails the push there.
    p = plan(repo, req, f, patches, series=False)
    if p["blocked"]:
        kind = p["blocked_kind"]
        hint = {
            "DriftError": "; rerun with --force to save them (recoverable) and go on",
            "BaseTreeError": "" if opts.get("three_way") else " (rerun with --3way to merge)",
            "ConflictError": "" if opts.get("three_way") else " (rerun with --3way to merge)",
        }[kind]
        raise Fail(kind, "%s: %s%s; nothing was changed" % (repo.path, p["blocked"], hint))
    if p["action"] == "noop":
        progress("%s %s is already applied; nothing to do" % (spec["name"], spec["version"]))
        return {"ok": True, "changed": False, "plan": p, "recovered": recovered}
    out = dict(_push_apply(repo, req, f, p, patches), recovered=recovered)
    prune_dev_sets(spec.get("dir"))
    return out


def _push_apply(repo: Repo, req: dict, f: dict, p: dict, patches: list) -> dict:
    spec, opts = req["set"], req.get("options", {})
    state = f["state"]
    applied_before = state.get("applied")
    head = f["head"]  # read under the lock this push holds
    pre = state.get("pre_deploy") or {"commit": head, "tree": f["tree"], "branch": repo.branch()}
    if p["action"] == "restore":
        made, target, tree = applied_before["patches"], applied_before["head"], applied_before.get("tree")
    else:
        progress("building %d patch commit(s) on %s" % (len(patches), pre["commit"][:12]))
        made, tree = build_commits(repo, pre["commit"], patches, spec, opts.get("three_way", False))
        target = made[-1]["commit"] if made else pre["commit"]
        p["patches"] = [{"name": n, "files": files, "ok": True, "error": None} for n, _, _, files in patches]
    # After the build: a set that does not apply leaves no saved edits behind either.
    saved = save_edits(repo, p["drift"], req, "push") if p["drift"] else None
    applied = {
        "name": spec["name"],
        "version": spec["version"],
        "fingerprint": spec["fingerprint"],
        "patches": made,
        "files": spec["files"],
        "head": target,
        "tree": tree or repo.rev(target + "^{tree}"),
        "three_way": bool(opts.get("three_way")),
        "dev": bool(spec.get("dev")),
        "by": req.get("by"),
        "at": now(),
    }
    last = {
        "action": "push",
        "version": spec["version"],
        "dev": applied["dev"],
        "from": applied_before and applied_before["version"],
        "by": req.get("by"),
        "at": applied["at"],
        "saved": saved,
    }
    message = "push %s %s%s%s by %s" % (
        spec["name"],
        spec["version"],
        " (dev snapshot)" if applied["dev"] else "",
        " over %s" % last["from"] if last["from"] else "",
        req.get("by"),
    )
    refs = {PRE_REF: pre["commit"], "refs/ddeploy/versions/" + spec["version"]: target}
    progress("switching the checkout to %s %s" % (spec["name"], spec["version"]))
    before = contents(repo, set(spec["files"]) | set((applied_before or {}).get("files", [])))
    transact(
        repo,
        req,
        "push",
        target,
        head,
        (applied_before or {}).get("files", []),
        {"applied": applied, "pre_deploy": pre, "last": last},
        refs,
        message,
        pre.get("branch"),
    )
    drop_changed(repo, before)
    return {"ok": True, "changed": True, "plan": p, "applied": applied, "saved": saved}
