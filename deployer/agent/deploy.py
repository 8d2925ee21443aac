"""push, rollback, plan (--diff), status, log and the lock commands: patch sets shipped to the
host, the facts of a checkout, the base gate, the plan, and the transactions that apply it."""

import hashlib
import json
import os

from .common import FIXED_DATES, Fail, PRE_REF, STATE_REF, now, progress
from .lock import acquire, describe_owner, holder_path, read_lock, release
from .repo import Repo
from .state import _state_blob, parse_state, read_state
from .transaction import journal_path, recover, save_edits, transact


class Scratch:
    """A temporary directory made on first use of .path (a push whose set has its own dir needs
    none), removed at the end of the with block."""

    def __init__(self, prefix: str):
        self.prefix, self._path = prefix, None

    @property
    def path(self) -> str:
        if self._path is None:
            import tempfile

            self._path = tempfile.mkdtemp(prefix=self.prefix)
        return self._path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._path is not None:
            import shutil

            shutil.rmtree(self._path, ignore_errors=True)


def load_patches(req: dict, workdir: Scratch) -> list:
    """Write/verify the set's patches as files; returns [(name, path, sha256, files)]."""
    spec = req["set"]
    out = []
    for p in spec["patches"]:
        if "/" in p["name"] or p["name"].startswith("."):
            raise Fail("PatchSetError", "patch name %r is not a plain file name" % p["name"])
        if "data_b64" in p:
            import base64

            data = base64.b64decode(p["data_b64"])
            path = os.path.join(spec.get("dir") or workdir.path, p["name"])
            if spec.get("dir"):
                os.makedirs(spec["dir"], exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(data)
        else:
            path = os.path.join(spec["dir"], p["name"])
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                raise Fail("NeedShip", "patch set not on the host yet") from None
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise Fail("NeedShip", "patch %s on the host differs; ship it again" % p["name"])
        if hashlib.sha256(data).hexdigest() != p["sha256"]:
            raise Fail(
                "ChecksumError", "patch %s arrived corrupted on the host (sha256 mismatch); push again" % p["name"]
            )
        out.append((p["name"], path, p["sha256"], p["files"]))
    return out


def check_series(repo: Repo, pre: str, patches: list, three_way: bool) -> list:
    """Dry-run the whole series on a throwaway index (nothing written); returns per-patch results."""
    with Scratch("ddeploy-plan-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp.path, "index")}
        repo.run("read-tree", pre, env=env)
        results, paths = [], []
        for name, path, _sha, files in patches:
            paths.append(path)
            p = repo.run("apply", "--cached", "--check", *paths, env=env, check=False)
            err = _last_line(p.stderr)
            results.append(
                {"name": name, "files": files, "ok": p.returncode == 0, "error": None if p.returncode == 0 else err}
            )
            if p.returncode != 0:
                if three_way:
                    results[-1]["error"] += " (a 3-way merge will be attempted)"
                break
        return results


def _last_line(raw: bytes) -> str:
    lines = [ln for ln in raw.decode(errors="replace").strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["failed"])[0]


def build_commits(repo: Repo, pre: str, patches: list, spec: dict, three_way: bool) -> list:
    """One commit per patch on top of pre, built in a private index: all or nothing."""
    work = os.path.join(repo.ddir, "tmp")
    os.makedirs(work, exist_ok=True)
    env = dict(FIXED_DATES, GIT_INDEX_FILE=os.path.join(work, "index-%d" % os.getpid()))
    try:
        repo.run("read-tree", pre, env=env)
        parent, made = pre, []
        for name, path, sha, _files in patches:
            args = ["apply", "--cached"] + (["--3way"] if three_way else []) + [path]
            p = repo.run(*args, env=env, check=False)
            if p.returncode != 0:
                raise Fail(
                    "ConflictError",
                    "patch %s does not apply to %s: %s; nothing was changed%s"
                    % (name, repo.path, _last_line(p.stderr), "" if three_way else " (try --3way)"),
                )
            tree = repo.out("write-tree", env=env)
            msg = "%s %s: %s\n\nsha256: %s\n" % (spec["name"], spec["version"], name, sha)
            parent = repo.out("commit-tree", tree, "-p", parent, "-m", msg, env=env)
            made.append({"name": name, "sha256": sha, "commit": parent})
        return made
    finally:
        try:
            os.unlink(env["GIT_INDEX_FILE"])
        except OSError:
            pass


def head_facts(repo: Repo) -> dict:
    """{head, tree, state, state_commit}: HEAD and the state record, from one git process. What
    push and rollback work from; facts() adds what status and plan report."""
    if not os.path.isdir(repo.gitdir):
        raise Fail("StateError", "%s is not a git checkout (no .git directory); clone SGLang there first" % repo.path)
    head, tree, *record = repo.objects(["HEAD^{commit}", "HEAD^{tree}", STATE_REF + "^{commit}"], more=_state_blob)
    if not head:
        raise Fail("StateError", "%s has no commit checked out" % repo.path)
    state_commit, state = parse_state(repo, *record)
    return {"head": head[0], "tree": tree and tree[0], "state": state, "state_commit": state_commit}


def facts(repo: Repo) -> dict:
    f = head_facts(repo)
    head, applied = f["head"], f["state"].get("applied")
    drift = repo.dirty()
    if applied and head != applied.get("head"):
        drift = ["HEAD moved from %s to %s" % (applied["head"][:12], head[:12])] + drift
    return {
        "head": head,
        "tree": f["tree"],
        "branch": repo.branch(),
        "state": f["state"],
        "state_commit": f["state_commit"],
        "drift": drift,
        "lock": read_lock(repo),
        "journal": os.path.exists(journal_path(repo)),
    }


def tree_blobs(repo: Repo, commit: str, paths: list) -> dict:
    """{path: blob id} of these paths in commit's tree (absent paths left out)."""
    if not paths:
        return {}
    raw = repo.run("ls-tree", "-r", "-z", commit, "--", *paths).stdout.decode(errors="surrogateescape")
    out = {}
    for entry in raw.split("\0"):
        if "\t" in entry:
            meta, path = entry.split("\t", 1)
            out[path] = meta.split()[2]
    return out


def missing_objects(repo: Repo, ids: list) -> list:
    """The object ids of `ids` that this repository's object store lacks (no lazy fetch)."""
    if not ids:
        return []
    query = "".join(i + "\n" for i in ids).encode()
    p = repo.run("cat-file", "--batch-check", input=query, env={"GIT_NO_LAZY_FETCH": "1"})
    return [line.split()[0] for line in p.stdout.decode().splitlines() if line.endswith(" missing")]


def check_base(repo: Repo, commit: str, preimages: dict, spec: dict) -> dict:
    """Does every file the set touches hold, in commit, exactly what the patches expect?

    preimages: {path: blob id (full or abbreviated) or None for a file the set creates}, in
    series order, from the patches' index lines. Returns {commit, against, checked, mismatched:
    [{path, why, expected, actual}]} (series order). Raises when a matching blob is not in the
    object store (a partial or shallow clone that lacks it): git apply could not read it.
    """
    have = tree_blobs(repo, commit, list(preimages))
    against = "%s %s" % (spec.get("name", "the set"), spec.get("version", "")) if spec else "the set"
    mismatched, present = [], []
    for path, want in preimages.items():
        got = have.get(path)
        if want is None and got is None:
            continue
        if want is not None and got is not None and got.startswith(want):
            present.append(got)
            continue
        if want is None:
            why = "%s already exists in the checkout (%s creates it)" % (path, against)
        elif got is None:
            why = "%s is missing from the checkout (%s edits it)" % (path, against)
        else:
            why = "%s is not the SGLang %s version that %s expects (blob %s, the checkout has %s)" % (
                path,
                spec.get("base_version", "base"),
                against,
                want[:12],
                got[:12],
            )
        mismatched.append({"path": path, "why": why, "expected": want, "actual": got})
    lost = missing_objects(repo, present)
    if lost:
        path = next(p for p, b in have.items() if b == lost[0])
        raise Fail(
            "BaseTreeError",
            "%s: the content of %s (blob %s) is not in the object store (a partial or shallow clone); "
            "fetch it (git -C %s fetch --refetch, or --unshallow) and push again; nothing was changed"
            % (repo.path, path, lost[0][:12], repo.path),
        )
    return {"commit": commit, "against": against, "checked": len(preimages), "mismatched": mismatched}


def need_merge_base(repo: Repo, mismatched: list) -> None:
    """--3way merges a mismatching file from the blob the patch was made against: it must be here."""
    lost = set(missing_objects(repo, [m["expected"] for m in mismatched if m["expected"]]))  # one git call
    for m in mismatched:
        if m["expected"] in lost:
            raise Fail(
                "BaseTreeError",
                "%s: cannot 3-way merge %s: the base blob %s the patch was made against is not in this "
                "checkout (a shallow clone?); fetch more history (git -C %s fetch --unshallow) and push "
                "again; nothing was changed" % (repo.path, m["path"], m["expected"][:12], repo.path),
            )


def in_the_way(repo: Repo, head: str, files: list) -> list:
    """Untracked (or ignored) things on disk where a switch to these files must write: a file,
    link or directory at a path that head lacks, or a non-directory where one of its parent
    directories must be. git status does not see the second kind, and a checkout deletes both."""
    tracked = set(tree_blobs(repo, head, list(files)))
    found = set()
    for path in files:
        if path in tracked:
            continue
        full = os.path.join(repo.path, path)
        if os.path.lexists(full):
            found.add(path)
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            full = os.path.join(repo.path, parent)
            if os.path.islink(full) or (os.path.lexists(full) and not os.path.isdir(full)):
                if not repo.rev("%s:%s" % (head, parent)):  # a tracked one is git apply's to refuse
                    found.add(parent)
                break
    return sorted(found)


def describe_drift(drift: list, blocking: list) -> str:
    """`hand edits in a, b; in the way: test (untracked, where the set writes)`, five names at most."""
    edits = [d for d in drift if d not in blocking]
    parts = ["hand edits in %s" % ", ".join(edits[:5])] if edits else []
    if blocking:
        parts.append("in the way: %s (untracked, where the set writes)" % ", ".join(blocking[:5]))
    return "; ".join(parts)


def plan(repo: Repo, req: dict, f: dict, patches: list) -> dict:
    spec, opts = req["set"], req.get("options", {})
    state = f["state"]
    applied = state.get("applied")
    pre = (state.get("pre_deploy") or {}).get("commit") or f["head"]
    out = {
        "version": spec["version"],
        "from": applied and applied["version"],
        "pre_deploy": pre,
        "files": spec["files"],
        "patches": [],
        "drift": [],
        "blocked": None,
        "blocked_kind": None,
        "base": None,
        "head": f["head"],
    }
    if applied and applied.get("fingerprint") == spec["fingerprint"] and applied["head"] == f["head"]:
        out["action"] = "noop"
    else:
        out["action"] = "replace" if applied else "apply"
    relevant = set(spec["files"]) | set((applied or {}).get("files", []))
    blocking = out["in_the_way"] = in_the_way(repo, f["head"], spec["files"])
    out["drift"] = sorted(set(repo.dirty(relevant)) | set(blocking))
    if applied and f["head"] != applied["head"]:
        out["drift"].insert(0, "HEAD moved since %s was applied" % applied["version"])
    if out["drift"] and not opts.get("force"):
        out["blocked"] = describe_drift(out["drift"], blocking)
        out["blocked_kind"] = "DriftError"
    if out["action"] != "noop":
        out["base"] = check_base(repo, pre, spec.get("preimages") or {}, spec)
        mismatched = out["base"]["mismatched"]
        if mismatched and not opts.get("three_way"):
            more = " (and %d more file(s))" % (len(mismatched) - 1) if len(mismatched) > 1 else ""
            out["blocked"] = out["blocked"] or "%s%s" % (mismatched[0]["why"], more)
            out["blocked_kind"] = out["blocked_kind"] or "BaseTreeError"
        elif mismatched:
            need_merge_base(repo, mismatched)
        out["patches"] = check_series(repo, pre, patches, opts.get("three_way", False))
        bad = [p for p in out["patches"] if not p["ok"]]
        if bad and not opts.get("three_way"):
            out["blocked"] = out["blocked"] or "patch %s does not apply: %s" % (bad[0]["name"], bad[0]["error"])
            out["blocked_kind"] = out["blocked_kind"] or "ConflictError"
    elif out["drift"] and opts.get("force"):
        out["action"] = "restore"  # same version, hand edits saved then reverted to the applied content
    return out


def op_push(repo: Repo, req: dict) -> dict:
    spec, opts = req["set"], req.get("options", {})
    if not os.path.isdir(repo.gitdir):
        raise Fail("StateError", "%s is not a git checkout (no .git directory); clone SGLang there first" % repo.path)
    with Scratch("ddeploy-push-") as workdir:
        patches = load_patches(req, workdir)  # NeedShip: the client sends the set in a second call
        acquire(repo, req)
        try:
            recovered = recover(repo)
            f = head_facts(repo)  # plan makes its own drift check, of the files it changes
            p = plan(repo, req, f, patches)
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
            saved = save_edits(repo, p["drift"], req, "push") if p["drift"] else None
            out = dict(_push_apply(repo, req, f, p, patches, saved), recovered=recovered)
            prune_dev_sets(spec.get("dir"))
            return out
        finally:
            release(repo)


DEV_SETS_KEPT = 3


def prune_dev_sets(current, keep: int = DEV_SETS_KEPT) -> None:
    """After a dev snapshot is applied, keep only the newest `keep` dev snapshots' patch files
    under .git/ddeploy/sets/ (each edit of the overlay ships one); released sets always stay.
    Rollback never needs them: it returns to recorded commits."""
    if not current or "+dev." not in os.path.basename(current):
        return
    root = os.path.dirname(current)
    others = [os.path.join(root, d) for d in os.listdir(root) if "+dev." in d and d != os.path.basename(current)]
    others.sort(key=lambda d: os.stat(d).st_mtime, reverse=True)
    import shutil

    for old in others[keep - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _push_apply(repo: Repo, req: dict, f: dict, p: dict, patches: list, saved) -> dict:
    spec, opts = req["set"], req.get("options", {})
    state = f["state"]
    applied_before = state.get("applied")
    head = repo.rev("HEAD^{commit}")
    pre = state.get("pre_deploy") or {"commit": head, "tree": repo.rev("HEAD^{tree}"), "branch": repo.branch()}
    if p["action"] == "restore":
        made, target = applied_before["patches"], applied_before["head"]
    else:
        progress("building %d patch commit(s) on %s" % (len(patches), pre["commit"][:12]))
        made = build_commits(repo, pre["commit"], patches, spec, opts.get("three_way", False))
        target = made[-1]["commit"] if made else pre["commit"]
    applied = {
        "name": spec["name"],
        "version": spec["version"],
        "fingerprint": spec["fingerprint"],
        "patches": made,
        "files": spec["files"],
        "head": target,
        "tree": repo.rev(target + "^{tree}"),
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
    return {"ok": True, "changed": True, "plan": p, "applied": applied, "saved": saved}


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


def op_status(repo: Repo, req: dict) -> dict:
    f = facts(repo)
    expect = req.get("expect")  # a set's preimages: do the touched files at the base match them?
    if expect:
        pre = (f["state"].get("pre_deploy") or {}).get("commit") or f["head"]
        f["base"] = check_base(repo, pre, expect["preimages"], expect)
    return {"ok": True, "facts": f}


def op_plan(repo: Repo, req: dict) -> dict:
    with Scratch("ddeploy-plan-") as workdir:
        patches = load_patches(req, workdir)
        f = facts(repo)
        p = plan(repo, req, f, patches)
        out = {"ok": True, "plan": p, "facts": f}
        if req.get("options", {}).get("diff"):
            out["diff"] = plan_diff(repo, req, f, p, patches)
        return out


DIFF_LIMIT = 512 * 1024  # bytes of diff text sent back per host; the rest is cut at a line end


DIFF_ARGS = ("diff", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames", "--binary")


def series_tree(repo: Repo, pre: str, patches: list, three_way: bool):
    """The tree push would commit: the series applied to pre in a throwaway index; None if it fails."""
    with Scratch("ddeploy-diff-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp.path, "index")}
        repo.run("read-tree", pre, env=env)
        for _name, path, _sha, _files in patches:
            args = ["apply", "--cached"] + (["--3way"] if three_way else []) + [path]
            if repo.run(*args, env=env, check=False).returncode != 0:
                return None
        p = repo.run("write-tree", env=env, check=False)
        return p.stdout.decode().strip() if p.returncode == 0 else None


def plan_diff(repo: Repo, req: dict, f: dict, p: dict, patches: list) -> dict:
    """The unified diff from HEAD's tree to the tree push would switch to, over the set's files
    and the applied set's files (hand edits in the work tree are the plan's drift, not diffed)."""
    applied = f["state"].get("applied") or {}
    files = sorted(set(req["set"]["files"]) | set(applied.get("files", [])))
    out = {"files": [], "text": "", "bytes": 0, "truncated": False, "note": None}
    if p["action"] in ("noop", "restore"):
        target = applied["head"] + "^{tree}"
    else:
        target = series_tree(repo, p["pre_deploy"], patches, req.get("options", {}).get("three_way", False))
    if target is None:
        return dict(out, text=None, note="no diff: the series does not apply on %s" % p["pre_deploy"][:12])
    names = repo.out("diff", "--no-renames", "--name-only", "-z", f["head"], target, "--", *files)
    out["files"] = [n for n in names.split("\0") if n]
    if not out["files"]:
        return out
    raw = repo.run(*DIFF_ARGS, f["head"], target, "--", *files).stdout
    out["bytes"] = len(raw)
    if len(raw) > DIFF_LIMIT:
        raw, out["truncated"] = raw[: raw.rfind(b"\n", 0, DIFF_LIMIT) + 1], True
    out["text"] = raw.decode(errors="replace")
    return out


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


def op_lock_status(repo: Repo, req: dict) -> dict:
    return {"ok": True, "lock": read_lock(repo)}


def op_lock_release(repo: Repo, req: dict) -> dict:
    """Remove a dead holder's record. A live holder's lock is the kernel's: it ends with the process."""
    owner = read_lock(repo)
    if owner is not None and owner["alive"]:
        raise Fail(
            "LockError",
            "checkout %s is locked by %s, which is still running; the lock goes when it ends "
            "(stop it with `kill %s` on the host if it hangs)"
            % (repo.path, describe_owner(owner), owner.get("pid", "PID")),
        )
    if owner is not None:
        try:
            os.unlink(holder_path(repo))
        except OSError:
            pass
    return {"ok": True, "released": owner is not None, "lock": owner}


def op_state(repo: Repo, req: dict) -> dict:
    """The state record alone (launch reads its kernel builds); empty when nothing was ever deployed."""
    if not os.path.isdir(repo.gitdir):
        return {"ok": True, "state": {"schema": 1, "applied": None, "pre_deploy": None}}
    return {"ok": True, "state": read_state(repo)[1]}
