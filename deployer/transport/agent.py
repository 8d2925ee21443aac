"""ddeploy's host-side helper: one transaction per host per command (stdlib only, Python >= 3.8).

Prints one JSON object on stdout ({"ok": true, ...} or {"ok": false, "error": {"kind",
"message"}}) and progress lines on stderr. OPs: status, state, plan, push, rollback, log,
lock-status, lock-release (deploys), sources, build (kernel builds), test (overlay tests), launch,
logs, stop (launched servers). The client runs it as `python -S -c BOOTSTRAP OP` with this source,
then the JSON request, on stdin (deployer/transport/agent_client.py); `python agent.py OP` with
the request on stdin runs it too. The reply shapes are the pydantic models of deployer/transport/protocol.py.

Why one program on the host: a push is a single round trip and a single transaction. Patch
commits are built in a private index (the work tree is untouched until they all exist), the switch
of the work tree is idempotent (per-file checkout of the target commit), and a journal written
before the switch lets any later run roll it forward. SIGHUP/SIGPIPE are ignored so a cut SSH
connection does not stop a transaction halfway. The state record's compare-and-swap on
refs/ddeploy/state is the commit point.

This program alone reads and writes the host's records (the client only sees its replies):
    refs/ddeploy/state      a chain of commits (parent = the previous record) whose tree holds one
                            file, state.json; every change is a new commit installed with a
                            compare-and-swap, so concurrent writers never lose each other's
                            updates, and the chain is the history (`ddeploy log`)
    refs/ddeploy/versions/V head commit of version V as last applied (`rollback --to V`)
    refs/ddeploy/pre-deploy the recorded pre-deploy commit while a version is applied
    refs/ddeploy/saved/*    hand edits saved by --force, shaped like a stash entry: the work-tree
                            version, parents the HEAD they were on and the index version (^2)
    .git/ddeploy/deploy.lock  the checkout's lock: fcntl.flock held by the agent for the whole
                            operation, released by the kernel when it ends or dies (no stale lock)
    .git/ddeploy/deploy.lock.json  the holder's record {by, user, host, pid, time, command}, for
                            messages; one left by a killed holder is replaced by the next command
    .git/ddeploy/journal.json  a transaction switched halfway; the next run rolls it forward
    .git/ddeploy/sets/      shipped patch sets; test-reports/, pycache/ (kept out of the work tree)
    <launch_dir>/launch.json   the last launch (topology, units with pid, start time, log, state)
state.json (schema 1; absent keys mean "never happened"): applied {name, version, fingerprint,
patches [{name, sha256, commit}], files, head, tree, three_way, dev, by, at} (dev: a dev snapshot
of the overlay, not a release), pre_deploy {commit, tree, branch}, last {action, version, dev,
from, by, at, saved}, builds {arch: {ok, nvcc, cuda_home,
source_hash, cache_dir, version, at, modules, known}}, tests {ok, rc, version, k, at, report,
tests, passed, failed, errors, skipped, duration, summary}; the client's models of these are in
deployer/transport/protocol.py.
"""

# The agent starts on every command, so its startup is on every command's critical path: modules
# that the common runs (status, a push with nothing to do) do not need are imported in the
# functions that use them (base64, shutil, tempfile, glob, xml), not here.
import hashlib
import json
import os
import re  # free: json imports it
import signal
import subprocess
import sys
import time

STATE_REF = "refs/ddeploy/state"
PRE_REF = "refs/ddeploy/pre-deploy"
ZERO = "0" * 40
IDENTITY = {
    "GIT_AUTHOR_NAME": "ddeploy",
    "GIT_AUTHOR_EMAIL": "ddeploy@localhost",
    "GIT_COMMITTER_NAME": "ddeploy",
    "GIT_COMMITTER_EMAIL": "ddeploy@localhost",
}
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

    def env(self, env=None) -> dict:
        full = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        full.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "GIT_OPTIONAL_LOCKS": "0"})
        full.update(IDENTITY)
        full.update(env or {})
        return full

    def run(self, *args, input=None, env=None, check=True):
        proc = subprocess.run(
            ["git", "--literal-pathspecs", "-C", self.path] + list(args),
            input=input,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env(env),
        )
        if check and proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise Fail(
                "RemoteCommandError",
                "git %s failed in %s: %s" % (args[0], self.path, err[-1] if err else proc.returncode),
            )
        return proc

    def out(self, *args, **kw) -> str:
        return self.run(*args, **kw).stdout.decode(errors="replace").strip()

    def rev(self, spec: str):
        p = self.run("rev-parse", "-q", "--verify", spec, check=False)
        return p.stdout.decode().strip() or None

    def objects(self, names: list, more=None) -> list:
        """Look up objects by name (`HEAD^{tree}`, `REV:path`; no newline in a name) in one
        `git cat-file --batch` process: [(id, type, content), or None where `rev-parse --verify`
        finds nothing]. more(the answers so far) may return further names, then asked of the same
        process (cat-file answers each name as it reads it)."""
        p = subprocess.Popen(
            ["git", "--literal-pathspecs", "-C", self.path, "cat-file", "--batch"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.env(),
        )
        found, asked = [], 0
        try:
            while names:
                asked += len(names)
                p.stdin.write("".join(n + "\n" for n in names).encode())
                p.stdin.flush()
                for _ in names:
                    header = p.stdout.readline().split()  # `<id> <type> <size>`, or `<name> missing`
                    if len(header) == 3 and header[2].isdigit():
                        content = p.stdout.read(int(header[2]) + 1)[:-1]
                        found.append((header[0].decode(), header[1].decode(), content))
                    else:
                        found.append(None)
                names, more = (more(found) if more else []), None
        except OSError:  # git is gone (a broken repository): what it did not answer was not found
            pass
        finally:
            for pipe in (p.stdin, p.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
            p.wait()
        return found + [None] * (asked - len(found))

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
    """(commit of refs/ddeploy/state or None, its state.json as a dict, defaults filled in)."""
    return parse_state(repo, *repo.objects([STATE_REF + "^{commit}"], more=_state_blob))


def _state_blob(found: list) -> list:
    """After the state ref's commit: the name of its state.json (nothing when there is no record)."""
    return [found[-1][0] + ":state.json"] if found[-1] else []


def parse_state(repo: Repo, commit, blob=None):
    """read_state from the objects found for `STATE_REF^{commit}` and then `_state_blob`."""
    state = {"schema": 1, "applied": None, "pre_deploy": None}
    if commit:
        data = blob[2] if blob and blob[1] == "blob" else b""  # what `git cat-file blob` would print
        try:
            state.update(json.loads(data.decode()))
        except ValueError:
            raise Fail("StateError", "%s in %s has no readable state.json" % (STATE_REF, repo.path)) from None
    return commit and commit[0], state


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
def hostname() -> str:
    return os.uname().nodename  # what socket.gethostname() returns (uname(2)), without importing socket


def lock_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "deploy.lock")


def holder_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "deploy.lock.json")


_HELD = {}  # lock file path -> the open fd whose flock this process holds


def _open_lock(repo: Repo) -> int:
    os.makedirs(repo.ddir, exist_ok=True)
    return os.open(lock_path(repo), os.O_RDWR | os.O_CREAT, 0o644)


def _lock_is_held(repo: Repo) -> bool:
    """Whether some process holds the flock (this one included, through another open file)."""
    import fcntl

    if not os.path.exists(lock_path(repo)):
        return False
    fd = _open_lock(repo)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own shared lock
    return False


def _read_holder(repo: Repo) -> dict:
    try:
        with open(holder_path(repo)) as fh:
            owner = json.load(fh)
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _holder_soon(repo: Repo) -> dict:
    """The record of a holder that may have taken the lock an instant ago (it writes it next)."""
    for _ in range(20):
        owner = _read_holder(repo)
        if owner:
            return owner
        time.sleep(0.05)
    return {}


def read_lock(repo: Repo):
    """The holder's record, with `alive`: whether the lock is held now. A record whose lock is not
    held was left by a process that died; the next command replaces it (nothing to break)."""
    owner, held = _read_holder(repo), _lock_is_held(repo)
    if not owner and not held:
        return None
    owner["alive"] = held
    return owner


def describe_owner(owner) -> str:
    age = time.time() - float(owner.get("time", time.time()))
    return "%s (pid %s on %s) running `%s` for %.0fs" % (
        owner.get("by", "?"),
        owner.get("pid", "?"),
        owner.get("host", "?"),
        owner.get("command", "?"),
        age,
    )


def acquire(repo: Repo, req: dict) -> None:
    """Take the checkout's lock for the rest of this process (or until release): fcntl.flock on
    .git/ddeploy/deploy.lock, which the kernel drops when the process dies, so there is never a
    stale lock to break. The holder's record beside it only says who holds it."""
    import fcntl

    fd = _open_lock(repo)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        owner = _holder_soon(repo)
        who = "by %s" % describe_owner(owner) if owner else "(its holder is still starting)"
        raise Fail(
            "LockError",
            "checkout %s is locked %s; wait for it to finish (the lock goes when that process ends)" % (repo.path, who),
        ) from None
    _HELD[lock_path(repo)] = fd
    left = _read_holder(repo)
    if left:
        progress(
            "the previous holder (pid %s, `%s`) ended without releasing the lock"
            % (left.get("pid", "?"), left.get("command", "?"))
        )
    owner = {
        "by": req.get("by", "?"),
        "user": req.get("by", "?").split("@")[0],
        "host": hostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "command": req.get("command", req.get("op")),
    }
    tmp = "%s.%d.tmp" % (holder_path(repo), os.getpid())
    with open(tmp, "w") as fh:
        json.dump(owner, fh)
    os.replace(tmp, holder_path(repo))


def release(repo: Repo) -> None:
    """Drop the record, then the flock (the lock file stays: unlinking it would let two processes
    lock two different files of the same name)."""
    fd = _HELD.pop(lock_path(repo), None)
    if fd is None:
        return
    try:
        os.unlink(holder_path(repo))
    except OSError:
        pass
    os.close(fd)


# ---------------------------------------------------------------- patch sets
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


# ---------------------------------------------------------------- facts
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


def journal_path(repo: Repo) -> str:
    return os.path.join(repo.ddir, "journal.json")


# ---------------------------------------------------------------- the base gate
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


# ---------------------------------------------------------------- plan
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


# ---------------------------------------------------------------- transactions
def save_edits(repo: Repo, files: list, req: dict, op: str) -> str:
    """Save the hand edits in `files` (and a moved HEAD) under refs/ddeploy/saved/<stamp>, shaped
    like a `git stash` entry so nothing staged is lost: a commit I (HEAD plus the index's version of
    these paths) and on top a commit W (parents HEAD and I) with their work-tree version, untracked
    and ignored files included. The ref names W: `git stash apply --index REF` brings both back."""
    work = os.path.join(repo.ddir, "tmp")
    os.makedirs(work, exist_ok=True)
    env = {"GIT_INDEX_FILE": os.path.join(work, "save-index-%d" % os.getpid())}
    real = [p for p in files if not p.startswith("HEAD moved")]
    head = repo.rev("HEAD^{commit}")
    stamp = "%s %s" % (op, req.get("by", "?"))
    try:
        repo.run("read-tree", "HEAD", env=env)
        if real:
            staged = repo.run("ls-files", "-s", "-z", "--", *real).stdout  # the real index's entries
            repo.run("rm", "-q", "-r", "--cached", "--ignore-unmatch", "--", *real, env=env)
            entries = [e for e in staged.split(b"\0") if e and b"\t" in e and e.split(b"\t")[0].split()[2] == b"0"]
            if entries:
                repo.run("update-index", "-z", "--index-info", input=b"\0".join(entries) + b"\0", env=env)
        index_tree = repo.out("write-tree", env=env)
        note = "index on %s: saved before %s" % (head[:12], stamp)
        index_commit = repo.out("commit-tree", index_tree, "-p", head, "-m", note)
        if real:
            repo.run("add", "-A", "-f", "--", *real, env=env)
        tree = repo.out("write-tree", env=env)
    finally:
        if os.path.exists(env["GIT_INDEX_FILE"]):
            os.unlink(env["GIT_INDEX_FILE"])
    msg = "ddeploy: hand edits saved before %s\n\n%s\n" % (stamp, "\n".join(files))
    commit = repo.out("commit-tree", tree, "-p", head, "-p", index_commit, "-m", msg)
    ref = "refs/ddeploy/saved/%s-%d" % (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), os.getpid())
    repo.run("update-ref", ref, commit, ZERO)
    progress(
        "saved hand edits in %d path(s) as %s (work tree and index; recover: git -C %s stash apply --index %s)"
        % (len(files), ref, repo.path, ref)
    )
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
        if os.path.islink(full) or os.path.isfile(full):
            os.unlink(full)
        elif os.path.isdir(full):
            import shutil

            shutil.rmtree(full)  # only after save_edits kept it: an untracked tree in the way
        prune_empty_parents(repo, path)


def prune_empty_parents(repo: Repo, path: str) -> None:
    """Remove the directories above a removed file that are now empty (never a non-empty one)."""
    parent = os.path.dirname(path)
    while parent:
        try:
            os.rmdir(os.path.join(repo.path, parent))
        except OSError:  # not empty, or already gone: stop at the first that stays
            if os.path.isdir(os.path.join(repo.path, parent)):
                return
        parent = os.path.dirname(parent)


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


def transact(
    repo: Repo,
    req: dict,
    op: str,
    target: str,
    old_head: str,
    extra_files: list,
    engine_state: dict,
    refs: dict,
    message: str,
    branch,
) -> None:
    files = sorted(set(repo.diff_names(old_head, target)) | set(extra_files))
    journal = {
        "op": op,
        "target": target,
        "files": files,
        "branch": branch,
        "refs": refs,
        "state": engine_state,
        "message": message,
        "by": req.get("by"),
        "command": req.get("command"),  # the real command line, as the lock owner records it
        "started": now(),
    }
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


# ---------------------------------------------------------------- plan --diff
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


# ---------------------------------------------------------------- kernel builds (`ddeploy build`)
# Minimum nvcc per arch (archs not listed rely on `nvcc --list-gpu-arch`).
MIN_NVCC = {(9, 0): (11, 8), (10, 0): (12, 8), (12, 0): (12, 8), (10, 3): (12, 9), (12, 1): (12, 9), (11, 0): (13, 0)}
# The kernel-build concern's sources (tests excluded): what a rebuild depends on.
KERNEL_DIR = "python/sglang/kernels/jit"
KERNEL_FILES = ["python/sglang/srt/speculative/ddtree_kernel.py", "python/sglang/srt/speculative/ddtree_build.py"]
DEFAULT_CACHE_ROOT = "$HOME/.cache/ddeploy/jit"
PREBUILD_MODULE = "sglang.srt.speculative.ddtree_build"
DDTREE_MODULE = "sgl_kernel_jit_speculative_ddtree"


class Toolkit:
    def __init__(self, cuda_home: str, version: tuple, archs):
        self.cuda_home, self.version, self.archs = cuda_home, tuple(version), archs

    @property
    def version_text(self) -> str:
        return "%d.%d" % self.version


def run_tool(argv: list, env=None, cwd=None):
    """(rc, stdout, stderr) of a command; rc 127 when it does not exist."""
    try:
        p = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=dict(os.environ, **(env or {}))
        )
    except OSError as exc:
        return 127, "", "%s: %s" % (argv[0], exc.strerror)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def last_text_line(*texts, default="no output") -> str:
    for text in texts:
        lines = text.strip().splitlines()
        if lines:
            return lines[-1]
    return default


def parse_nvidia_smi(text: str) -> list:
    """`name, compute_cap` CSV lines (noheader) -> [(name, (major, minor))]."""
    gpus = []
    for line in text.strip().splitlines():
        name, _, cap = line.rpartition(",")
        m = re.match(r"\s*(\d+)\.(\d+)\s*\Z", cap)
        if not name.strip() or not m:
            raise Fail("BuildError", "cannot read nvidia-smi output line %r (expected 'name, compute_cap')" % line)
        gpus.append((name.strip(), (int(m.group(1)), int(m.group(2)))))
    return gpus


def parse_nvcc_version(text: str):
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_gpus_match(target: dict, gpus):
    """The inventory's arch against nvidia-smi's (None where the host has no nvidia-smi)."""
    if not gpus:
        return None
    want = tuple(target["capability"])
    for name, cap in gpus:
        if cap != want:
            raise Fail(
                "BuildError",
                "inventory says gpu.arch %s (%s) in %s, but nvidia-smi reports %s, compute "
                "capability %d.%d (sm_%d%d); fix gpu.arch in the inventory"
                % (target["arch"], target["model"], target["source"], name, cap[0], cap[1], cap[0], cap[1]),
            )
    return gpus[0][0]


def probe_gpus():
    rc, out, err = run_tool(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
    if rc == 127:
        return None
    if rc != 0:
        raise Fail("BuildError", "nvidia-smi failed (exit %d): %s" % (rc, last_text_line(err)))
    return parse_nvidia_smi(out)


def resolve_cuda_home(target: dict) -> str:
    """CUDA_HOME from the inventory, else /usr/local/cuda, else the toolkit of the nvcc on PATH."""
    if target.get("cuda_home"):
        return target["cuda_home"]
    if os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        return "/usr/local/cuda"
    import shutil

    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise Fail(
            "BuildError",
            "no CUDA toolkit found (no CUDA_HOME in %s, no /usr/local/cuda, no nvcc on PATH); "
            "install CUDA >= 12.8 or set env.CUDA_HOME" % target["source"],
        )
    real = os.path.realpath(nvcc)
    try:  # a wrapper script (exec /path/bin/nvcc "$@") names the real toolkit
        with open(real, errors="replace") as fh:
            m = re.search(r"^exec (/\S*/bin/nvcc) ", fh.read(4096), re.M)
        real = m.group(1) if m else real
    except OSError:
        pass
    return os.path.dirname(os.path.dirname(real))


def probe_toolkit(target: dict, cuda_home: str) -> Toolkit:
    nvcc = cuda_home.rstrip("/") + "/bin/nvcc"
    rc, out, _err = run_tool([nvcc, "--version"])
    if rc != 0:
        where = "CUDA_HOME=%s%s" % (cuda_home, " from %s" % target["source"] if target.get("cuda_home") else "")
        raise Fail(
            "BuildError",
            "no working nvcc at %s (%s; exit %d); install the CUDA toolkit (>= 12.8 for "
            "Blackwell) or point env.CUDA_HOME at one" % (nvcc, where, rc),
        )
    version = parse_nvcc_version(out)
    if version is None:
        raise Fail("BuildError", "cannot read the version from `%s --version`: %r" % (nvcc, out.strip()[-200:]))
    rc, listed, _err = run_tool([nvcc, "--list-gpu-arch"])
    archs = frozenset(re.findall(r"compute_\d+[af]?", listed)) if rc == 0 else None
    return Toolkit(cuda_home, version, archs or None)


def check_toolkit_supports(target: dict, toolkit: Toolkit) -> None:
    major, minor = target["capability"]
    arch = "sm_%d%d" % (major, minor)
    need = MIN_NVCC.get((major, minor))
    nvcc = "%s/bin/nvcc" % toolkit.cuda_home
    if need and toolkit.version < need:
        raise Fail(
            "BuildError",
            "%s needs nvcc >= %d.%d, but %s is %s; install a newer CUDA toolkit on the host "
            "or point env.CUDA_HOME at one" % (arch, need[0], need[1], nvcc, toolkit.version_text),
        )
    if toolkit.archs is not None and "compute_%d%d" % (major, minor) not in toolkit.archs:
        listed = " ".join(sorted(toolkit.archs, key=lambda a: int(re.sub(r"\D", "", a))))
        raise Fail(
            "BuildError",
            "nvcc %s at %s cannot build %s (its --list-gpu-arch: %s); use a toolkit that "
            "supports %s" % (toolkit.version_text, nvcc, arch, listed, arch),
        )


def kernel_source_hash(checkout: str):
    """sha256 over `sha256sum`-style lines of the kernel sources (sorted paths), or None without any."""
    found = []
    for root, _dirs, names in os.walk(os.path.join(checkout, KERNEL_DIR)):
        found += [os.path.relpath(os.path.join(root, n), checkout) for n in names if n.startswith("ddtree")]
    found += [f for f in KERNEL_FILES if os.path.isfile(os.path.join(checkout, f))]
    if not any(f.startswith(KERNEL_DIR) for f in found):
        return None
    lines = []
    for rel in sorted(set(found)):
        with open(os.path.join(checkout, rel), "rb") as fh:
            lines.append("%s  %s\n" % (hashlib.sha256(fh.read()).hexdigest(), rel))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


# What a kernel build compiles and links against besides the sources and nvcc: a new torch (its
# headers and ABI), flashinfer (speculative_sampling's headers) or tvm-ffi (SGLang's JIT loader)
# needs a new build, so their versions are part of the build key.
BUILD_PACKAGES = ("torch", "flashinfer-python", "apache-tvm-ffi")
_PYTHON_PROBE = """import importlib.util as u, json
from importlib import metadata
s = u.find_spec("sglang")
versions = {}
for name in %r:
    try:
        versions[name] = metadata.version(name)
    except Exception:
        versions[name] = None
print(json.dumps({"sglang": s.submodule_search_locations[0] if s and s.submodule_search_locations else "",
                  "packages": versions}))
""" % (BUILD_PACKAGES,)


def probe_python(target: dict, checkout: str) -> dict:
    """The host python must import sglang from this checkout (an editable install), not elsewhere;
    the versions of BUILD_PACKAGES it has ({name: version or None})."""
    rc, out, err = run_tool([target["python"], "-c", _PYTHON_PROBE], cwd="/")
    if rc != 0:
        raise Fail(
            "BuildError",
            "cannot run the host python %s (from %s): %s"
            % (target["python"], target["source"], last_text_line(err, default="exit %d" % rc)),
        )
    try:
        facts = json.loads(out.strip().splitlines()[-1])
        got, packages = str(facts["sglang"]), dict(facts["packages"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise Fail(
            "BuildError", "the host python %s printed %r, not what it was asked" % (target["python"], out[-200:])
        ) from None
    want = checkout.rstrip("/") + "/python/sglang"
    if not got:
        raise Fail(
            "BuildError",
            "%s cannot import sglang; install the checkout into it (pip install -e %s/python)"
            % (target["python"], checkout),
        )
    if os.path.realpath(got) != os.path.realpath(want):
        raise Fail(
            "BuildError",
            "%s imports sglang from %s, not from the checkout %s; install the checkout "
            "editable (pip install -e %s/python)" % (target["python"], got, want, checkout),
        )
    return packages


def packages_text(packages: dict) -> str:
    return ", ".join("%s %s" % (name, packages.get(name) or "-") for name in BUILD_PACKAGES)


def expand_home(root: str) -> str:
    """A leading ~ or $HOME of the JIT cache root is expanded on the host (nothing else is)."""
    home = os.environ.get("HOME", "")
    for prefix in ("~", "$HOME"):
        if root == prefix or root.startswith(prefix + "/"):
            return (home + root[len(prefix) :]).rstrip("/")
    return root.rstrip("/")


def cache_has_build(cache_dir: str, capability) -> bool:
    import glob

    pattern = "sm%d%d*/%s/build-*/deps-*/*.so" % (capability[0], capability[1], DDTREE_MODULE)
    return any(os.path.isfile(p) for p in glob.glob(os.path.join(glob.escape(cache_dir), pattern)))


def plan_build(repo: Repo, req: dict) -> dict:
    """Facts (applied set, python, GPU, toolkit, sources) -> what a build would do; writes nothing."""
    target, opts = req["target"], req.get("options", {})
    _c, state = read_state(repo)
    applied = state.get("applied")
    if not applied:
        raise Fail(
            "BuildError",
            "no patch set is applied to %s; push one first (ddeploy push --host %s)" % (repo.path, target["name"]),
        )
    packages = probe_python(target, repo.path)
    gpu = check_gpus_match(target, probe_gpus())
    toolkit = probe_toolkit(target, resolve_cuda_home(target))
    check_toolkit_supports(target, toolkit)
    source_hash = kernel_source_hash(repo.path)
    if source_hash is None:
        raise Fail(
            "BuildError", "no DDTree kernel sources under %s/%s; is the patch set applied?" % (repo.path, KERNEL_DIR)
        )
    major, minor = target["capability"]
    plan = {
        "host": target["name"],
        "arch": "sm_%d%d" % (major, minor),
        "capability": [major, minor],
        "toolkit": {"cuda_home": toolkit.cuda_home, "nvcc": toolkit.version_text},
        "source_hash": source_hash,
        "version": applied.get("version", "?"),
        "gpu": gpu,
        "cache_dir": "%s/%s" % (expand_home(target.get("cache_root") or DEFAULT_CACHE_ROOT), source_hash[:16]),
        "packages": packages,
        "action": "build",
        "reason": "",
    }
    built_with, with_packages = "%s|%s|%s" % (source_hash, plan["arch"], toolkit.version_text), packages_text(packages)
    plan["key"] = "%s|%s" % (built_with, with_packages)
    current = (state.get("builds") or {}).get(plan["arch"]) or {}
    known = current.get("known") or {}
    plan["previous_cache_dir"] = current.get("cache_dir")
    if opts.get("force"):
        plan["reason"] = "--force"
    elif plan["key"] not in known and any(k.startswith(built_with + "|") for k in known):
        plan["reason"] = "the host's python packages changed since the last build (now %s)" % with_packages
    elif plan["key"] not in known:
        plan["reason"] = "no build for these kernel sources, arch and nvcc yet"
    elif not cache_has_build(plan["cache_dir"], plan["capability"]):
        plan["reason"] = "the recorded build is gone from %s" % plan["cache_dir"]
    else:
        prior = known[plan["key"]]
        plan["action"] = "noop"
        plan["reason"] = "already built for these sources (version %s, %s)" % (
            prior.get("version", "?"),
            prior.get("at", "?"),
        )
    return plan


def update_section(repo: Repo, section: str, change, message: str) -> dict:
    """CAS one non-engine section (builds, tests): change(old value) -> new value, on the latest record."""
    for _ in range(20):
        old, state = read_state(repo)
        state[section] = change(state.get(section))
        if write_state(repo, old, state, message):
            return state
        time.sleep(0.05)
    raise Fail("StateError", "%s kept changing while recording; run the command again" % STATE_REF)


def record_build(repo: Repo, plan: dict, summary, ok: bool) -> None:
    """builds[arch] = this build (ok or not) plus `known`: every good build by cache key."""
    record = {
        "ok": ok,
        "nvcc": plan["toolkit"]["nvcc"],
        "cuda_home": plan["toolkit"]["cuda_home"],
        "source_hash": plan["source_hash"],
        "cache_dir": plan["cache_dir"],
        "version": plan["version"],
        "at": now(),
        "modules": [
            {k: m.get(k) for k in ("module", "status", "seconds", "path", "reason")}
            for m in (summary or {}).get("modules", [])
        ],
    }

    def change(builds):
        builds = dict(builds or {})
        known = dict((builds.get(plan["arch"]) or {}).get("known") or {})
        if ok:
            known[plan["key"]] = {k: v for k, v in record.items() if k != "ok"}
        builds[plan["arch"]] = dict(record, known=known)
        return builds

    update_section(repo, "builds", change, "build %s %s" % (plan["arch"], plan["source_hash"][:12]))


def record_reuse(repo: Repo, plan: dict) -> None:
    """A no-op build of sources built before (e.g. after a rollback): make that build current again."""

    def change(builds):
        builds = dict(builds or {})
        entry = builds.get(plan["arch"]) or {}
        if entry.get("ok") and (entry.get("source_hash"), entry.get("version")) == (
            plan["source_hash"],
            plan["version"],
        ):
            return builds
        known = entry.get("known") or {}
        # `version` is the applied set this build now serves (launch looks it up by version).
        builds[plan["arch"]] = dict(known[plan["key"]], ok=True, version=plan["version"], known=known)
        return builds

    update_section(repo, "builds", change, "build %s %s (cached)" % (plan["arch"], plan["source_hash"][:12]))


def drop_arch_cache(plan: dict) -> None:
    """--force: SGLang keeps an existing leaf even when told to recompile, so start from nothing."""
    import glob
    import shutil

    pattern = "sm%d%d*" % tuple(plan["capability"])
    for d in glob.glob(os.path.join(glob.escape(plan["cache_dir"]), pattern)):
        if os.path.isdir(d) and not os.path.islink(d):
            shutil.rmtree(d)


def seed_cache(plan: dict) -> None:
    """Hard-link SGLang's own modules from the previous build: they do not include the overlay's
    kernel sources, and their cache leaves are immutable and self-verifying."""
    import glob

    previous = plan.get("previous_cache_dir")
    if not previous or previous == plan["cache_dir"] or not os.path.isdir(previous):
        return
    pattern = "sm%d%d*/sgl_kernel_jit_*" % tuple(plan["capability"])
    for src in glob.glob(os.path.join(glob.escape(previous), pattern)):
        rel = os.path.relpath(src, previous)
        dst = os.path.join(plan["cache_dir"], rel)
        if rel.endswith("/" + DDTREE_MODULE) or not os.path.isdir(src) or os.path.exists(dst):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        subprocess.run(["cp", "-al", src, dst], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_prebuild(repo: Repo, target: dict, plan: dict) -> dict:
    """The prebuild in the host's python env; its stderr is streamed, its stdout is a JSON summary."""
    major, minor = plan["capability"]
    argv = [
        target["python"],
        "-m",
        PREBUILD_MODULE,
        "--arch",
        "%d.%d" % (major, minor),
        "--cache-dir",
        plan["cache_dir"],
        "--json",
    ]
    # Bytecode goes into the checkout's .git so the work tree stays clean (no drift).
    env = dict(
        os.environ, CUDA_HOME=plan["toolkit"]["cuda_home"], PYTHONPYCACHEPREFIX=os.path.join(repo.ddir, "pycache")
    )
    sys.stderr.flush()
    try:
        p = subprocess.run(argv, cwd=repo.path, env=env, stdout=subprocess.PIPE, stderr=None)
        rc, out = p.returncode, p.stdout.decode(errors="replace")
    except OSError as exc:
        rc, out = 127, ""
        progress("%s: %s" % (target["python"], exc.strerror))
    try:
        summary = json.loads(out)
    except ValueError:
        summary = None
    if rc != 0 or not isinstance(summary, dict):
        failed = [m for m in (summary or {}).get("modules", []) if m.get("status") == "failed"]
        detail = (
            "%s: %s" % (failed[0]["module"], failed[0].get("reason", "")[-300:]) if failed else "see the output above"
        )
        raise Fail("BuildError", "kernel build for %s failed (exit %d): %s" % (plan["arch"], rc, detail))
    return summary


def serve_hint(plan: dict) -> str:
    return (
        "serve with the prebuilt kernels: SGLANG_JIT_CACHE_DIR=%s SGLANG_CRASH_ON_JIT_COMPILE=1 "
        "python -m sglang.launch_server ..." % plan["cache_dir"]
    )


def announce(plan: dict) -> None:
    gpu = " (%s, checked with nvidia-smi)" % plan["gpu"] if plan["gpu"] else " (from the inventory)"
    progress(
        "arch %s%s, nvcc %s at %s, sources %s"
        % (plan["arch"], gpu, plan["toolkit"]["nvcc"], plan["toolkit"]["cuda_home"], plan["source_hash"][:12])
    )


def op_build(repo: Repo, req: dict) -> dict:
    """Plan and (unless it is a no-op) run the kernel build; records it in the state (section builds).
    options.reuse_only: never compile, only make an existing build of these sources current again."""
    plan = plan_build(repo, req)
    if req.get("options", {}).get("reuse_only") and plan["action"] != "noop":
        return {"ok": True, "changed": False, "plan": plan, "build": None}
    announce(plan)
    if plan["action"] == "noop":
        record_reuse(repo, plan)
        progress("nothing to build: %s" % plan["reason"])
        progress(serve_hint(plan))
        return {"ok": True, "changed": False, "plan": plan, "build": None}
    progress("building (%s) into %s" % (plan["reason"], plan["cache_dir"]))
    acquire(repo, req)
    try:
        if req.get("options", {}).get("force"):
            drop_arch_cache(plan)
        else:
            seed_cache(plan)
        try:
            summary = run_prebuild(repo, req["target"], plan)
        except Fail:
            record_build(repo, plan, None, ok=False)
            raise
        record_build(repo, plan, summary, ok=True)
    finally:
        release(repo)
    progress(serve_hint(plan))
    return {"ok": True, "changed": True, "plan": plan, "build": summary}


def op_sources(repo: Repo, req: dict) -> dict:
    return {"ok": True, "source_hash": kernel_source_hash(repo.path)}


# ---------------------------------------------------------------- overlay tests (`ddeploy test --remote`)
TEST_DIR = "test/srt/ddtree"


def junit_totals(xml_text: str):
    """Totals over every <testsuite> of a pytest JUnit report, or None when it cannot be read."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(xml_text)  # noqa: S314 - the report pytest just wrote here
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0) or 0) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    duration = sum(float(s.get("time", 0) or 0) for s in suites)
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "tests": total["tests"],
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
        "duration": duration,
    }


def describe_totals(t: dict) -> str:
    return "%d passed, %d failed, %d skipped, %d errors in %.1fs" % (
        t["passed"],
        t["failed"],
        t["skipped"],
        t["errors"],
        t["duration"],
    )


def check_applied_for_tests(state: dict, req: dict) -> dict:
    applied = state.get("applied")
    name = req["target"]["name"]
    if not applied:
        raise Fail(
            "StateError",
            "no patch set is applied to %s, so it has no overlay tests; push one first "
            "(ddeploy push --host %s)" % (req["checkout"], name),
        )
    want = req.get("requested")
    if want and applied.get("fingerprint") != want["fingerprint"]:
        raise Fail(
            "StateError",
            "%s %s is applied, not the requested %s %s; push %s first or drop --version"
            % (applied.get("name"), applied.get("version"), want["name"], want["version"], want["version"]),
        )
    return applied


def op_test(repo: Repo, req: dict) -> dict:
    """pytest on the applied set's overlay tests, JUnit report inside .git; the report comes back in
    the reply and its totals are recorded in the state (section tests)."""
    _c, state = read_state(repo)
    applied = check_applied_for_tests(state, req)
    opts = req.get("options", {})
    reports = os.path.join(repo.ddir, "test-reports")
    os.makedirs(reports, exist_ok=True)
    junit = os.path.join(reports, "%s.xml" % req["stamp"])
    progress(
        "running %s of %s %s with %s%s"
        % (
            TEST_DIR,
            applied.get("name"),
            applied.get("version"),
            req["target"]["python"],
            " (-k %s)" % opts["k"] if opts.get("k") else "",
        )
    )
    argv = [
        req["target"]["python"],
        "-m",
        "pytest",
        TEST_DIR,
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit2",
        "--junitxml=" + junit,
    ] + (["-k", opts["k"]] if opts.get("k") else [])
    env = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(repo.ddir, "pycache"))
    sys.stderr.flush()
    try:  # all of pytest's output on stderr: the client streams it line by line as `[host] ...`
        rc = subprocess.run(argv, cwd=repo.path, env=env, stdout=2, stderr=2).returncode
    except OSError as exc:
        rc = 127
        progress("%s: %s" % (argv[0], exc.strerror))
    try:
        with open(junit, errors="replace") as fh:
            xml_text = fh.read()
    except FileNotFoundError:
        xml_text = None
    totals = junit_totals(xml_text) if xml_text is not None else None
    record = {
        "ok": bool(totals and totals["failed"] == 0 and totals["errors"] == 0 and totals["tests"] > 0 and rc == 0),
        "rc": rc,
        "version": applied.get("version"),
        "k": opts.get("k"),
        "at": now(),
        "report": req.get("report") or junit,
    }
    record.update(totals or {})
    record["summary"] = describe_totals(totals) if totals else "pytest exit %d" % rc
    update_section(repo, "tests", lambda _old: record, "test %s: %s" % (applied.get("version"), record["summary"]))
    return {"ok": True, "record": record, "junit": xml_text, "host_report": junit}


# ---------------------------------------------------------------- launches (`ddeploy launch|logs|stop`)
LAUNCH_RECORD = "launch.json"


def read_launch(base: str):
    """The last launch record, None when nothing was launched; unreadable is an error, not 'nothing'."""
    path = os.path.join(base, LAUNCH_RECORD)
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Fail(
            "StateError",
            "cannot read the launch record %s (%s); fix its permissions or run as its owner" % (path, exc.strerror),
        ) from None
    try:
        return json.loads(text)
    except ValueError:
        raise Fail("StateError", "%s is not valid JSON; remove it after checking nothing runs" % path) from None


def write_launch(base: str, record: dict) -> None:
    path = os.path.join(base, LAUNCH_RECORD)
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh, indent=2)
    os.rename(path + ".tmp", path)


def start_time(pid: int):
    """Field 22 of /proc/PID/stat (the command name in field 2 may hold spaces), None when gone or a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def alive_units(record) -> list:
    """The recorded units whose pid still runs with the recorded start time (a reused pid is not ours)."""
    return [u for u in (record or {}).get("units", []) if start_time(int(u["pid"])) == str(u["starttime"])]


def start_unit(remote: str, unit: dict) -> dict:
    log = os.path.join(remote, unit["name"] + ".log")
    with open(log, "a") as fh:
        fh.write("=== ddeploy launch %s at %s ===\n" % (unit["script_file"], now()))
        fh.flush()
        # Its own session (setsid): it leads its own process group, and stop signals exactly that group.
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
    return {"name": unit["name"], "pid": proc.pid, "starttime": started, "log": log}


def write_units(remote: str, units: list) -> None:
    os.makedirs(remote, exist_ok=True)
    for unit in units:
        for fname, text, mode in ((unit["script_file"], unit["script"], 0o755), (unit["env_file"], unit["env"], 0o600)):
            path = os.path.join(remote, fname)
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(path + ".tmp", mode)
            os.rename(path + ".tmp", path)


def tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as fh:
            return " | ".join(fh.read().strip().splitlines()[-lines:])
    except OSError:
        return ""


def op_launch(repo: Repo, req: dict) -> dict:
    """Write the host's units, start each detached, record pids; refuse while a recorded launch runs."""
    base, units = req["base"], req["units"]
    previous = read_launch(base)
    running = alive_units(previous)
    if running:
        raise Fail(
            "StateError",
            "topology %s is still running (pid %s); run `ddeploy stop --host %s` first"
            % (previous["topology"], ", ".join(str(u["pid"]) for u in running), req["target"]["name"]),
        )
    remote = os.path.join(base, req["topology"])
    write_units(remote, units)
    record = {"topology": req["topology"], "dir": remote, "state": "running", "started_at": now(), "units": []}
    try:
        for unit in units:
            s = start_unit(remote, unit)
            record["units"].append(s)
            progress("started %s (pid %d), log %s" % (s["name"], s["pid"], s["log"]))
    finally:  # whatever started is recorded, so `stop` can find it even if a later unit failed
        write_launch(base, record)
    time.sleep(float(req.get("settle", 1.0)))  # a script that fails at once (bad python, bad flag) shows it here
    alive = alive_units(record)
    dead = [u for u in record["units"] if u not in alive]
    if dead:
        raise Fail("RemoteCommandError", "%s exited right after start: %s" % (dead[0]["name"], tail(dead[0]["log"])))
    return {"ok": True, "record": record}


def op_logs(repo: Repo, req: dict) -> dict:
    """The last launch's logs on stderr (streamed by the client); --follow ends when the server exits."""
    base = req["base"]
    record = read_launch(base)
    if record is None:
        raise Fail(
            "StateError",
            "nothing was launched here (no %s); run `ddeploy launch` first" % os.path.join(base, LAUNCH_RECORD),
        )
    files = [u["log"] for u in record["units"]]
    argv = ["tail", "-n", str(int(req.get("lines", 50)))]
    if req.get("follow"):
        running = alive_units(record)
        argv += ["-F"] + (["--pid=%d" % running[0]["pid"]] if running else [])
    sys.stderr.flush()
    rc = subprocess.run(argv + files, stdout=2, stderr=subprocess.DEVNULL).returncode
    return {"ok": True, "rc": rc, "files": files}


def op_stop(repo: Repo, req: dict) -> dict:
    """TERM each recorded process group (verified by start time), wait up to grace, KILL the rest."""
    base, grace = req["base"], max(1.0, float(req.get("grace", 30)))
    record = read_launch(base)
    running = alive_units(record)
    if not running:
        if record is None:
            what = "no launch recorded in %s" % os.path.join(base, LAUNCH_RECORD)
        elif record.get("state") == "stopped":
            what = "last launch %s was stopped at %s" % (record["topology"], record.get("stopped_at", "?"))
        else:
            what = "last launch %s has exited (see `ddeploy logs --host %s`)" % (
                record["topology"],
                req["target"]["name"],
            )
        raise Fail("StateError", "nothing to stop: %s" % what)
    for u in running:
        signal_group(int(u["pid"]), signal.SIGTERM)
    deadline = time.time() + grace
    while alive_units({"units": running}) and time.time() < deadline:
        time.sleep(0.1)
    outcome = {}
    for u in running:
        if alive_units({"units": [u]}):
            signal_group(int(u["pid"]), signal.SIGKILL)
            outcome[u["name"]] = "killed"
        else:
            outcome[u["name"]] = "terminated"
        progress("%s (pid %s): %s" % (u["name"], u["pid"], outcome[u["name"]]))
    record["state"] = "stopped"
    record["stopped_at"] = now()
    write_launch(base, record)
    return {"ok": True, "record": record, "outcome": outcome}


def signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def op_state(repo: Repo, req: dict) -> dict:
    """The state record alone (launch reads its kernel builds); empty when nothing was ever deployed."""
    if not os.path.isdir(repo.gitdir):
        return {"ok": True, "state": {"schema": 1, "applied": None, "pre_deploy": None}}
    return {"ok": True, "state": read_state(repo)[1]}


OPS = {
    "push": op_push,
    "rollback": op_rollback,
    "status": op_status,
    "plan": op_plan,
    "log": op_log,
    "lock-status": op_lock_status,
    "lock-release": op_lock_release,
    "build": op_build,
    "sources": op_sources,
    "test": op_test,
    "state": op_state,
    "launch": op_launch,
    "logs": op_logs,
    "stop": op_stop,
}
# Work on launches beside the checkout, not in it: the checkout need not exist.
NO_CHECKOUT = ("launch", "logs", "stop")
# Interactive: they end with the client (a cut connection stops `logs --follow`).
ATTACHED = ("logs",)


def detach() -> None:
    """A cut connection must not kill a transaction halfway: ignore hangups, leave the session."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        os.setsid()
    except OSError:
        pass


def main(argv: list, request=None) -> int:
    """argv: [program, OP]; request: the JSON text (from the client's program), else read on stdin."""
    try:
        req = json.loads(request if request is not None else sys.stdin.buffer.read().decode())
        op = argv[1] if len(argv) > 1 else req.get("op")
        if op not in ATTACHED:
            detach()
        if op not in OPS:
            raise Fail("UsageError", "unknown agent operation %r" % op)
        if op not in NO_CHECKOUT and not os.path.isdir(req["checkout"]):
            raise Fail(
                "StateError",
                "checkout %s does not exist on this host; create it (clone SGLang "
                "0.5.23) or fix `checkout` in the inventory" % req["checkout"],
            )
        result = OPS[op](Repo(req["checkout"]), req)
    except Fail as exc:
        result = {"ok": False, "error": {"kind": exc.kind, "message": str(exc)}}
    except Exception as exc:  # noqa: BLE001 - reported as data, never a traceback on the wire
        result = {
            "ok": False,
            "error": {"kind": "RemoteCommandError", "message": "agent failed: %s: %s" % (type(exc).__name__, exc)},
        }
    try:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    return 0


if __name__ == "__main__":  # `python agent.py OP` < request (the client's boot program calls main itself)
    sys.exit(main(sys.argv))
