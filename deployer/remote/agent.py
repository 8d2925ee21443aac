"""ddeploy's host-side helper: one transaction per host per command (stdlib only, Python >= 3.8).

Run as `<python> -c <this source> OP` with a JSON request on stdin; prints one JSON object on
stdout ({"ok": true, ...} or {"ok": false, "error": {"kind", "message"}}) and progress lines on
stderr. OPs: status, plan, push, rollback, log, lock-status, lock-release.

Why one program on the host: a push is a single round trip and a single transaction. Patch
commits are built in a private index (the work tree is untouched until they all exist), the switch
of the work tree is idempotent (per-file checkout of the target commit), and a journal written
before the switch lets any later run roll it forward. SIGHUP/SIGPIPE are ignored so a cut SSH
connection does not stop a transaction halfway. The state record's compare-and-swap on
refs/ddeploy/state is the commit point (schema: deployer/state.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

STATE_REF = "refs/ddeploy/state"
PRE_REF = "refs/ddeploy/pre-deploy"
ZERO = "0" * 40
IDENTITY = {"GIT_AUTHOR_NAME": "ddeploy", "GIT_AUTHOR_EMAIL": "ddeploy@localhost",
            "GIT_COMMITTER_NAME": "ddeploy", "GIT_COMMITTER_EMAIL": "ddeploy@localhost"}
# Patch commits are reproducible: the same set on the same base gives the same commits everywhere.
FIXED_DATES = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000"}

_quiet = [False]


class Fail(Exception):
    """An error reported to the client; kind names a deployer.errors class."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def progress(msg: str) -> None:
    if _quiet[0]:
        return
    try:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        _quiet[0] = True  # the client went away; keep working silently


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------- git
class Repo:
    def __init__(self, path: str):
        self.path = path
        self.gitdir = os.path.join(path, ".git")
        self.ddir = os.path.join(self.gitdir, "ddeploy")

    def run(self, *args, input=None, env=None, check=True):
        full = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        full.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C",
                     "GIT_OPTIONAL_LOCKS": "0"})
        full.update(IDENTITY)
        full.update(env or {})
        proc = subprocess.run(["git", "--literal-pathspecs", "-C", self.path] + list(args), input=input,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full)
        if check and proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise Fail("RemoteCommandError", "git %s failed in %s: %s" % (args[0], self.path, err[-1] if err else proc.returncode))
        return proc

    def out(self, *args, **kw) -> str:
        return self.run(*args, **kw).stdout.decode(errors="replace").strip()

    def rev(self, spec: str):
        p = self.run("rev-parse", "-q", "--verify", spec, check=False)
        return p.stdout.decode().strip() or None

    def exists(self, obj: str) -> bool:
        return self.run("cat-file", "-e", obj, check=False).returncode == 0

    def branch(self):
        p = self.run("symbolic-ref", "-q", "--short", "HEAD", check=False)
        return p.stdout.decode().strip() or None

    def diff_names(self, a: str, b: str) -> list:
        return [f for f in self.out("diff", "--no-renames", "--name-only", "-z", a, b).split("\0") if f]

    def dirty(self, files=None) -> list:
        """Paths whose index or work tree differ from HEAD, or untracked among `files`."""
        args = ["status", "--porcelain", "-z", "--no-renames"]
        if files is not None:
            if not files:
                return []
            args += ["--untracked-files=all", "--"] + sorted(files)
        else:
            args += ["--untracked-files=no"]
        raw = self.run(*args).stdout.decode(errors="replace")
        return sorted({e[3:] for e in raw.split("\0") if len(e) > 3})


# ---------------------------------------------------------------- state record
def read_state(repo: Repo):
    commit = repo.rev(STATE_REF + "^{commit}")
    state = {"schema": 1, "applied": None, "pre_deploy": None}
    if commit:
        p = repo.run("cat-file", "blob", commit + ":state.json", check=False)
        try:
            state.update(json.loads(p.stdout.decode()))
        except ValueError:
            raise Fail("StateError", "%s in %s has no readable state.json" % (STATE_REF, repo.path))
    return commit, state


def write_state(repo: Repo, old, state: dict, message: str):
    blob = repo.out("hash-object", "-w", "--stdin", input=(json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
    tree = repo.out("mktree", input=("100644 blob %s\tstate.json\n" % blob).encode())
    commit = repo.out("commit-tree", tree, *(["-p", old] if old else []), "-m", message)
    ok = repo.run("update-ref", "-m", message, STATE_REF, commit, old or ZERO, check=False).returncode == 0
    return commit if ok else None


def commit_state(repo: Repo, engine_part: dict, message: str) -> None:
    """CAS the engine's sections onto the latest record; other writers' sections are kept."""
    for _ in range(20):
        old, state = read_state(repo)
        state.update(engine_part)
        if write_state(repo, old, state, message):
            return
        time.sleep(0.05)
    raise Fail("StateError", "%s kept changing while recording; run the command again" % STATE_REF)


# ---------------------------------------------------------------- lock
def lock_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "lock")


def read_lock(repo: Repo):
    path = lock_path(repo)
    if not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "owner.json")) as fh:
            owner = json.load(fh)
    except (OSError, ValueError):
        owner = {}
    if owner.get("host") == socket.gethostname() and owner.get("pid"):
        owner["alive"] = pid_alive(int(owner["pid"]))
    return owner


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_owner(owner) -> str:
    age = time.time() - float(owner.get("time", time.time()))
    return "%s (pid %s on %s) running `%s` for %.0fs" % (owner.get("by", "?"), owner.get("pid", "?"),
                                                     owner.get("host", "?"), owner.get("command", "?"), age)


def acquire(repo: Repo, req: dict) -> None:
    os.makedirs(repo.ddir, exist_ok=True)
    path = lock_path(repo)
    for _ in range(2):
        try:
            os.mkdir(path)
            break
        except FileExistsError:
            owner = read_lock(repo) or {}
            if owner.get("alive") is False and _break_stale(path, owner):
                progress("broke the stale lock of dead pid %s" % owner.get("pid"))
                continue
            if not owner:
                raise Fail("LockError", "checkout %s is locked (no owner recorded); if no deploy runs, "
                           "run `ddeploy lock release`" % repo.path)
            raise Fail("LockError", "checkout %s is locked by %s; wait for it, or if it is stale run "
                       "`ddeploy lock release`" % (repo.path, describe_owner(owner)))
    else:
        raise Fail("LockError", "checkout %s: cannot take the lock" % repo.path)
    owner = {"by": req.get("by", "?"), "user": req.get("by", "?").split("@")[0], "host": socket.gethostname(),
             "pid": os.getpid(), "time": time.time(), "command": req.get("command", req.get("op"))}
    with open(os.path.join(path, "owner.json"), "w") as fh:
        json.dump(owner, fh)


def _break_stale(path: str, owner: dict) -> bool:
    # Rename first so two breakers cannot both win.
    grave = "%s.stale-%d" % (path, os.getpid())
    try:
        os.rename(path, grave)
    except OSError:
        return False
    shutil.rmtree(grave, ignore_errors=True)
    return True


def release(repo: Repo) -> None:
    shutil.rmtree(lock_path(repo), ignore_errors=True)


# ---------------------------------------------------------------- patch sets
def load_patches(req: dict, workdir: str) -> list:
    """Write/verify the set's patches as files; returns [(name, path, sha256, files)]."""
    spec = req["set"]
    out = []
    for p in spec["patches"]:
        if "/" in p["name"] or p["name"].startswith("."):
            raise Fail("PatchSetError", "patch name %r is not a plain file name" % p["name"])
        if "data_b64" in p:
            data = base64.b64decode(p["data_b64"])
            path = os.path.join(workdir, p["name"])
            with open(path, "wb") as fh:
                fh.write(data)
        else:
            path = os.path.join(spec["dir"], p["name"])
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                raise Fail("NeedShip", "patch set not on the host yet")
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise Fail("NeedShip", "patch %s on the host differs; ship it again" % p["name"])
        if hashlib.sha256(data).hexdigest() != p["sha256"]:
            raise Fail("ChecksumError", "patch %s arrived corrupted on the host (sha256 mismatch); push again" % p["name"])
        out.append((p["name"], path, p["sha256"], p["files"]))
    return out


def check_series(repo: Repo, pre: str, patches: list, three_way: bool) -> list:
    """Dry-run the whole series on a throwaway index (nothing written); returns per-patch results."""
    tmp = tempfile.mkdtemp(prefix="ddeploy-plan-")
    env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
    try:
        repo.run("read-tree", pre, env=env)
        results, paths = [], []
        for name, path, _sha, files in patches:
            paths.append(path)
            p = repo.run("apply", "--cached", "--check", *paths, env=env, check=False)
            err = _last_line(p.stderr)
            results.append({"name": name, "files": files, "ok": p.returncode == 0, "error": None if p.returncode == 0 else err})
            if p.returncode != 0:
                if three_way:
                    results[-1]["error"] += " (a 3-way merge will be attempted)"
                break
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
                raise Fail("ConflictError", "patch %s does not apply to %s: %s; nothing was changed%s" % (
                    name, repo.path, _last_line(p.stderr), "" if three_way else " (try --3way)"))
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


# ---------------------------------------------------------------- facts
def facts(repo: Repo) -> dict:
    if not os.path.isdir(repo.gitdir):
        raise Fail("StateError", "%s is not a git checkout (no .git directory); clone SGLang there first" % repo.path)
    head = repo.rev("HEAD^{commit}")
    if not head:
        raise Fail("StateError", "%s has no commit checked out" % repo.path)
    state_commit, state = read_state(repo)
    applied = state.get("applied")
    drift = repo.dirty()
    if applied and head != applied.get("head"):
        drift = ["HEAD moved from %s to %s" % (applied["head"][:12], head[:12])] + drift
    return {"head": head, "tree": repo.rev("HEAD^{tree}"), "branch": repo.branch(), "state": state,
            "state_commit": state_commit, "drift": drift, "lock": read_lock(repo),
            "journal": os.path.exists(journal_path(repo))}


def journal_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "journal.json")


# ---------------------------------------------------------------- plan
def plan(repo: Repo, req: dict, f: dict, patches: list) -> dict:
    spec, opts = req["set"], req.get("options", {})
    state = f["state"]
    applied = state.get("applied")
    pre = (state.get("pre_deploy") or {}).get("commit") or f["head"]
    out = {"version": spec["version"], "from": applied and applied["version"], "pre_deploy": pre,
           "files": spec["files"], "patches": [], "drift": [], "blocked": None, "head": f["head"]}
    if not repo.exists(spec["base_tree"] + "^{tree}"):
        raise Fail("BaseTreeError", "%s does not contain the SGLang %s base tree %s; it is not a %s checkout "
                   "(or a shallow clone): clone the base there" % (repo.path, spec["base_version"], spec["base_tree"][:12], spec["base_version"]))
    if applied and applied.get("fingerprint") == spec["fingerprint"] and applied["head"] == f["head"]:
        out["action"] = "noop"
    else:
        out["action"] = "replace" if applied else "apply"
    relevant = set(spec["files"]) | set((applied or {}).get("files", []))
    out["drift"] = repo.dirty(relevant)
    if applied and f["head"] != applied["head"]:
        out["drift"].insert(0, "HEAD moved since %s was applied" % applied["version"])
    if out["drift"] and not opts.get("force"):
        out["blocked"] = "hand edits in %s" % ", ".join(out["drift"][:5])
    if out["action"] != "noop":
        out["patches"] = check_series(repo, pre, patches, opts.get("three_way", False))
        bad = [p for p in out["patches"] if not p["ok"]]
        if bad and not opts.get("three_way"):
            out["blocked"] = out["blocked"] or "patch %s does not apply: %s" % (bad[0]["name"], bad[0]["error"])
    elif out["drift"] and opts.get("force"):
        out["action"] = "restore"  # same version, hand edits saved then reverted to the applied content
    return out


# ---------------------------------------------------------------- transactions
def save_edits(repo: Repo, files: list, req: dict, op: str) -> str:
    """Commit the hand edits in `files` (and a moved HEAD) under refs/ddeploy/saved/<stamp>."""
    work = os.path.join(repo.ddir, "tmp")
    os.makedirs(work, exist_ok=True)
    env = {"GIT_INDEX_FILE": os.path.join(work, "save-index-%d" % os.getpid())}
    real = [p for p in files if not p.startswith("HEAD moved")]
    try:
        repo.run("read-tree", "HEAD", env=env)
        if real:
            repo.run("add", "-A", "--", *real, env=env)
        tree = repo.out("write-tree", env=env)
    finally:
        if os.path.exists(env["GIT_INDEX_FILE"]):
            os.unlink(env["GIT_INDEX_FILE"])
    msg = "ddeploy: hand edits saved before %s by %s\n\n%s\n" % (op, req.get("by", "?"), "\n".join(files))
    commit = repo.out("commit-tree", tree, "-p", "HEAD", "-m", msg)
    ref = "refs/ddeploy/saved/%s-%d" % (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), os.getpid())
    repo.run("update-ref", ref, commit, ZERO)
    progress("saved hand edits in %d path(s) as %s (recover: git -C %s diff HEAD %s)" % (len(files), ref, repo.path, ref))
    if real:
        switch_files(repo, "HEAD", real)
    return ref


def switch_files(repo: Repo, target: str, files: list) -> None:
    """Make index and work tree match `target` for exactly these paths (idempotent)."""
    if not files:
        return
    present = set(f for f in repo.out("ls-tree", "-r", "-z", "--name-only", target, "--", *files).split("\0") if f)
    if present:
        repo.run("checkout", target, "--", *sorted(present))
    for path in sorted(set(files) - present):
        repo.run("rm", "-q", "-f", "--cached", "--ignore-unmatch", "--", path)
        full = os.path.join(repo.path, path)
        if os.path.lexists(full):
            os.unlink(full)


def write_journal(repo: Repo, journal: dict) -> None:
    tmp = journal_path(repo) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(journal, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, journal_path(repo))


def finish(repo: Repo, j: dict, pause_mid_switch: float = 0.0) -> None:
    """Roll a journaled transaction forward: work tree, HEAD, refs, then the state record."""
    if pause_mid_switch:  # test hook: leave the work tree half switched for a while
        switch_files(repo, j["target"], j["files"][:1])
        progress("pausing %.1fs in the middle of the switch (test hook)" % pause_mid_switch)
        time.sleep(pause_mid_switch)
    switch_files(repo, j["target"], j["files"])
    if j.get("branch"):
        repo.run("update-ref", "-m", j["message"], "refs/heads/" + j["branch"], j["target"])
        repo.run("symbolic-ref", "HEAD", "refs/heads/" + j["branch"])
    else:
        repo.run("update-ref", "--no-deref", "-m", j["message"], "HEAD", j["target"])
    for ref, value in j.get("refs", {}).items():
        if value:
            repo.run("update-ref", ref, value)
        else:
            repo.run("update-ref", "-d", ref, check=False)
    commit_state(repo, j["state"], j["message"])
    os.unlink(journal_path(repo))


def recover(repo: Repo) -> bool:
    path = journal_path(repo)
    if not os.path.exists(path):
        return False
    with open(path) as fh:
        j = json.load(fh)
    progress("completing an interrupted %s (%s)" % (j.get("op", "?"), j.get("message", "").splitlines()[0]))
    finish(repo, j)
    return True


def transact(repo: Repo, req: dict, op: str, target: str, old_head: str, extra_files: list, engine_state: dict,
             refs: dict, message: str, branch) -> None:
    files = sorted(set(repo.diff_names(old_head, target)) | set(extra_files))
    journal = {"op": op, "target": target, "files": files, "branch": branch, "refs": refs,
               "state": engine_state, "message": message, "by": req.get("by"), "started": now()}
    # Test hook (DDEPLOY_TEST_AGENT_PAUSE="[before_switch|mid_switch:]SECONDS"): a window in which
    # a test cuts the connection or kills this process.
    where, _, secs = str(req.get("options", {}).get("pause") or "").rpartition(":")
    pause = float(secs or 0)
    if pause and where in ("", "before_switch"):
        progress("pausing %.1fs before switching the checkout (test hook)" % pause)
        time.sleep(pause)
    write_journal(repo, journal)
    finish(repo, journal, pause if where == "mid_switch" else 0.0)


def op_push(repo: Repo, req: dict) -> dict:
    spec, opts = req["set"], req.get("options", {})
    if not os.path.isdir(repo.gitdir):
        raise Fail("StateError", "%s is not a git checkout (no .git directory); clone SGLang there first" % repo.path)
    workdir = tempfile.mkdtemp(prefix="ddeploy-push-")
    try:
        patches = load_patches(req, workdir)  # NeedShip: the client rsyncs the set and asks again
        acquire(repo, req)
        try:
            recovered = recover(repo)
            f = facts(repo)
            p = plan(repo, req, f, patches)
            p["recovered"] = recovered
            if p["blocked"]:
                kind = "DriftError" if p["drift"] and not opts.get("force") else "ConflictError"
                hint = ("; rerun with --force to save them (recoverable) and go on" if kind == "DriftError"
                        else "" if opts.get("three_way") else " (rerun with --3way to merge)")
                raise Fail(kind, "%s: %s%s; nothing was changed" % (repo.path, p["blocked"], hint))
            if p["action"] == "noop":
                progress("%s %s is already applied; nothing to do" % (spec["name"], spec["version"]))
                return {"ok": True, "changed": False, "plan": p}
            saved = save_edits(repo, p["drift"], req, "push") if p["drift"] else None
            return _push_apply(repo, req, f, p, patches, saved)
        finally:
            release(repo)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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
    applied = {"name": spec["name"], "version": spec["version"], "fingerprint": spec["fingerprint"],
               "patches": made, "files": spec["files"], "head": target, "tree": repo.rev(target + "^{tree}"),
               "three_way": bool(opts.get("three_way")), "by": req.get("by"), "at": now()}
    last = {"action": "push", "version": spec["version"], "from": applied_before and applied_before["version"],
            "by": req.get("by"), "at": applied["at"], "saved": saved}
    message = "push %s %s%s by %s" % (spec["name"], spec["version"],
                                      " over %s" % last["from"] if last["from"] else "", req.get("by"))
    refs = {PRE_REF: pre["commit"], "refs/ddeploy/versions/" + spec["version"]: target}
    progress("switching the checkout to %s %s" % (spec["name"], spec["version"]))
    transact(repo, req, "push", target, head, (applied_before or {}).get("files", []),
             {"applied": applied, "pre_deploy": pre, "last": last}, refs, message, pre.get("branch"))
    return {"ok": True, "changed": True, "plan": p, "applied": applied, "saved": saved}


def op_rollback(repo: Repo, req: dict) -> dict:
    opts = req.get("options", {})
    acquire(repo, req)
    try:
        recovered = recover(repo)
        f = facts(repo)
        state = f["state"]
        applied = state.get("applied")
        if not applied:
            return {"ok": True, "changed": False, "recovered": recovered, "message": "nothing is applied; nothing to roll back"}
        pre = state["pre_deploy"]
        to = opts.get("to")
        if to == applied["version"]:
            return {"ok": True, "changed": False, "message": "%s is already applied" % to}
        target = pre["commit"]
        if to:
            target = repo.rev("refs/ddeploy/versions/%s^{commit}" % to)
            if not target or repo.run("merge-base", "--is-ancestor", pre["commit"], target, check=False).returncode:
                known = [r.rsplit("/", 1)[1] for r in repo.out("for-each-ref", "--format=%(refname)", "refs/ddeploy/versions").split()]
                raise Fail("StateError", "version %s was never applied on %s (known: %s)" % (to, repo.path, ", ".join(known) or "none"))
        relevant = set(applied["files"]) | set(repo.diff_names(f["head"], target))
        drift = repo.dirty(relevant)
        if f["head"] != applied["head"]:
            drift.insert(0, "HEAD moved since %s was applied" % applied["version"])
        if drift and not opts.get("force"):
            raise Fail("DriftError", "%s: hand edits in %s; rerun with --force to save them (recoverable) and "
                       "roll back; nothing was changed" % (repo.path, ", ".join(drift[:5])))
        saved = save_edits(repo, drift, req, "rollback") if drift else None
        return _rollback_apply(repo, req, f, target, to, saved, recovered)
    finally:
        release(repo)


def _rollback_apply(repo, req, f, target, to, saved, recovered) -> dict:
    state = f["state"]
    applied, pre = state["applied"], state["pre_deploy"]
    engine = {"last": {"action": "rollback", "version": to, "from": applied["version"], "by": req.get("by"),
                       "at": now(), "saved": saved}}
    if to:
        _c, older = _find_applied(repo, to, pre["commit"])
        engine["applied"] = dict(older, at=now(), by=req.get("by"))
        refs = {}
    else:
        engine.update({"applied": None, "pre_deploy": None})
        refs = {PRE_REF: None}
    message = "rollback %s -> %s by %s" % (applied["version"], to or "pre-deploy", req.get("by"))
    progress("rolling back %s to %s" % (applied["version"], to or "the pre-deploy state %s" % pre["commit"][:12]))
    transact(repo, req, "rollback", target, repo.rev("HEAD^{commit}"), applied["files"], engine, refs, message,
             pre.get("branch"))
    return {"ok": True, "changed": True, "from": applied["version"], "to": to, "head": target,
            "tree": repo.rev(target + "^{tree}"), "saved": saved, "recovered": recovered}


def _find_applied(repo: Repo, version: str, pre: str):
    """The newest state record in which `version` was applied on this pre-deploy commit."""
    for line in repo.out("log", "--format=%H", STATE_REF, "--").split():
        p = repo.run("cat-file", "blob", line + ":state.json", check=False)
        try:
            applied = json.loads(p.stdout.decode()).get("applied")
        except ValueError:
            continue
        if applied and applied["version"] == version and repo.run(
                "merge-base", "--is-ancestor", pre, applied["head"], check=False).returncode == 0:
            return line, applied
    raise Fail("StateError", "no record of %s being applied in %s" % (version, STATE_REF))


def op_status(repo: Repo, req: dict) -> dict:
    f = facts(repo)
    return {"ok": True, "facts": f}


def op_plan(repo: Repo, req: dict) -> dict:
    workdir = tempfile.mkdtemp(prefix="ddeploy-plan-")
    try:
        patches = load_patches(req, workdir)
        f = facts(repo)
        return {"ok": True, "plan": plan(repo, req, f, patches), "facts": f}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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
    owner = read_lock(repo)
    if owner is not None:
        release(repo)
    return {"ok": True, "released": owner is not None, "lock": owner}


OPS = {"push": op_push, "rollback": op_rollback, "status": op_status, "plan": op_plan, "log": op_log,
       "lock-status": op_lock_status, "lock-release": op_lock_release}


def main(argv: list) -> int:
    # A cut connection must not kill a transaction halfway: ignore hangups, detach from the session.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        os.setsid()
    except OSError:
        pass
    try:
        req = json.loads(sys.stdin.read())
        op = argv[1] if len(argv) > 1 else req.get("op")
        if op not in OPS:
            raise Fail("UsageError", "unknown agent operation %r" % op)
        if not os.path.isdir(req["checkout"]):
            raise Fail("StateError", "checkout %s does not exist on this host; create it (clone SGLang "
                       "0.5.23) or fix `checkout` in the inventory" % req["checkout"])
        result = OPS[op](Repo(req["checkout"]), req)
    except Fail as exc:
        result = {"ok": False, "error": {"kind": exc.kind, "message": str(exc)}}
    except Exception as exc:  # noqa: BLE001 - reported as data, never a traceback on the wire
        result = {"ok": False, "error": {"kind": "RemoteCommandError", "message": "agent failed: %s: %s" % (type(exc).__name__, exc)}}
    try:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
