"""The host-side agent must run on a plain host: Python >= 3.8 syntax and the standard library only,
shipped as one bundle of its package's modules."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from deployer.agent.common import Fail
from deployer.agent.facts import facts
from deployer.agent.repo import Repo
from deployer.agent.state import read_state, update_section
from deployer.transport.agent_client import (
    AGENT_PACKAGE,
    BOOTSTRAP,
    agent_argv,
    agent_bundle,
    agent_digest,
    agent_sources,
    agent_stdin,
    bundle_digest,
)

PARTS = {name: src.decode() for name, src in agent_sources().items()}


@pytest.mark.parametrize("part", [*PARTS, "bootstrap"])
def test_agent_is_python38_syntax_and_stdlib_only(part):
    tree = ast.parse(PARTS.get(part, BOOTSTRAP), feature_version=(3, 8))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    froms = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported |= {n.module.split(".")[0] for n in froms if n.module and n.level == 0}
    imported -= {"__future__"}
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    relative = {f"ddeploy_agent.{n.module}" for n in froms if n.level == 1}
    assert relative <= set(PARTS), relative - set(PARTS)  # within the bundle


def test_the_bundle_is_every_module_of_the_package():
    modules = {p.stem for p in AGENT_PACKAGE.glob("*.py")} - {"__main__"}
    assert set(agent_sources()) == {"ddeploy_agent"} | {f"ddeploy_agent.{m}" for m in modules - {"__init__"}}


def test_agent_reports_errors_as_json_not_tracebacks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "deployer.agent", "status"],
        capture_output=True,
        text=True,
        cwd=AGENT_PACKAGE.parent.parent,
        input=json.dumps({"checkout": str(tmp_path / "nope")}),
    )
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"] is False
    assert result["error"]["kind"] == "StateError" and "does not exist on this host" in result["error"]["message"]
    proc = subprocess.run(
        [sys.executable, "-m", "deployer.agent", "explode"],
        capture_output=True,
        text=True,
        cwd=AGENT_PACKAGE.parent.parent,
        input=json.dumps({"checkout": str(tmp_path)}),
    )
    assert json.loads(proc.stdout)["error"]["kind"] == "UsageError"


def test_plan_is_data_computed_before_anything_is_written(tmp_path, patch_sets):
    """The same plan object drives dry-run, push and --json; here on a local checkout, no network."""
    from deployer.patchset.sglang_base import clone_base, ensure_base
    from deployer.cli.views import describe_plan
    from deployer.ops.deploy import Options, plan_host
    from deployer.inventory import local_host
    from deployer.patchset.release import load_patch_set

    checkout = clone_base(tmp_path / "co")
    host = local_host().model_copy(update={"checkout": str(checkout)})
    base = ensure_base()
    lines: list[str] = []
    ps = load_patch_set(str(patch_sets["v2"]))
    out = plan_host(host, ps, Options(dry_run=True), lines.append)
    plan = out.to_data()["plan"]
    assert describe_plan(out.result.plan, ps) == "would apply ddtree 0.2.0 (3 patches, 3 files)"
    assert plan == {
        "action": "apply",
        "blocked": None,
        "blocked_kind": None,
        "base": {"commit": base.commit, "against": "ddtree 0.2.0", "checked": 3, "mismatched": []},
        "drift": [],
        "in_the_way": [],
        "from": None,
        "head": base.commit,
        "pre_deploy": base.commit,
        "version": "0.2.0",
        "files": [
            "python/sglang/srt/speculative/ddtree_stub.py",
            "python/sglang/version.py",
            "python/sglang/__init__.py",
        ],
        "patches": [
            {
                "name": "0001-builder.patch",
                "files": ["python/sglang/srt/speculative/ddtree_stub.py"],
                "ok": True,
                "error": None,
            },
            {"name": "0002-wiring.patch", "files": ["python/sglang/version.py"], "ok": True, "error": None},
            {"name": "0003-extra.patch", "files": ["python/sglang/__init__.py"], "ok": True, "error": None},
        ],
    }
    assert not (checkout / ".git" / "ddeploy").exists()


def test_agent_source_and_request_travel_on_stdin_not_in_argv(tmp_path):
    """argv is only `python -S -c BOOTSTRAP OP DIGEST` (what `ps` on the host shows): one fixed
    program and the bundle's sha256; the source and the request come on stdin."""
    secret = str(tmp_path / "nope-a-path-only-in-the-request")
    argv = agent_argv(sys.executable, "status")
    assert argv == [sys.executable, "-S", "-c", BOOTSTRAP, "status", agent_digest()] and len(BOOTSTRAP) < 2000
    proc = subprocess.run(argv, input=agent_stdin({"checkout": secret}), capture_output=True)
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["error"]["kind"] == "StateError" and secret in result["error"]["message"]


def test_agent_started_before_its_request_waits_for_it(tmp_path):
    """The program goes first and the agent starts on it; the request may come later. An agent
    that never gets one (the client gave up) ends with an error reply and touches nothing."""
    checkout = tmp_path / "co"
    checkout.mkdir()
    argv = agent_argv(sys.executable, "status")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(agent_stdin())
    proc.stdin.flush()
    time.sleep(0.3)  # the agent is up and reading
    assert proc.poll() is None
    proc.stdin.write(json.dumps({"checkout": str(checkout)}).encode())
    out, _ = proc.communicate(timeout=30)
    assert json.loads(out.splitlines()[-1])["error"]["message"].startswith(f"{checkout} is not a git checkout")
    proc = subprocess.run(argv, input=agent_stdin(), capture_output=True, timeout=30)
    reply = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == 0 and reply["ok"] is False and "JSONDecodeError" in reply["error"]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["co"] and not list(checkout.iterdir())


def test_a_standby_agent_never_given_a_command_ends_quietly(tmp_path):
    """A kept connection's standby agent (control_master.py) ends when its stdin closes before any
    input came: exit 0, nothing written, nothing touched."""
    env = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(agent_argv(sys.executable, "push"), input=b"", capture_output=True, env=env, timeout=30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")
    assert not (tmp_path / "cache").exists()


def host_call(env: dict, request: dict, *, send: bool, op: str = "status") -> tuple[dict, bytes]:
    """One agent run as on a host (`python -S -c BOOTSTRAP OP DIGEST`): its reply and its stdout."""
    stdin = agent_stdin(request, send=send)
    proc = subprocess.run(agent_argv(sys.executable, op), input=stdin, capture_output=True, env=env)
    return json.loads(proc.stdout.splitlines()[-1]), proc.stdout


def test_the_host_keeps_the_agent_by_its_hash_and_later_calls_only_name_it(tmp_path):
    """The first call sends the bundle (~100 KB) and the host keeps it compiled under the bundle's
    sha256; a later call sends only `0` and the request, and runs the same agent."""
    env = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    request = {"checkout": str(tmp_path / "nope")}
    assert len(agent_stdin(request, send=True)) > 50_000 > 1_000 > len(agent_stdin(request, send=False))
    reply, out = host_call(env, request, send=True)
    assert reply["error"]["kind"] == "StateError" and b"ddeploy-agent kept " + agent_digest().encode() in out
    [kept] = (tmp_path / "cache" / "ddeploy" / "agent").iterdir()
    assert kept.name.startswith(agent_digest() + "-") and kept.suffix == ".marshal"
    assert oct(kept.parent.stat().st_mode & 0o777) == "0o700"
    reply, out = host_call(env, request, send=False)
    assert reply["error"]["kind"] == "StateError" and str(tmp_path / "nope") in reply["error"]["message"]
    assert b"kept" not in out  # nothing new kept


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing", "unwritable"])
def test_a_host_without_an_intact_copy_asks_for_the_agent_and_never_runs_a_damaged_one(tmp_path, damage):
    """A call that only names the hash finds a cut-off, altered or missing copy: the agent answers
    NeedAgent (nothing run); the client then sends the bundle, which is compiled and kept again. An
    unwritable cache only costs sending it every time."""
    cache = tmp_path / "cache"
    env = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(cache)}
    request = {"checkout": str(tmp_path / "nope")}
    host_call(env, request, send=True)
    [kept] = (cache / "ddeploy" / "agent").iterdir()
    data = kept.read_bytes()
    if damage == "truncated":
        kept.write_bytes(data[:100])
    elif damage == "flipped":  # one byte of the code, the file's size and name unchanged
        kept.write_bytes(data[:-200] + bytes([data[-200] ^ 1]) + data[-199:])
    elif damage == "missing":
        kept.unlink()
    else:  # a file where the cache's directory belongs: not writable, even by root
        shutil.rmtree(cache / "ddeploy")
        (cache / "ddeploy").write_text("")
    reply, _ = host_call(env, request, send=False)
    assert reply["ok"] is False and reply["error"]["kind"] == "NeedAgent", reply
    reply, out = host_call(env, request, send=True)
    assert reply["error"]["kind"] == "StateError"
    assert (b"ddeploy-agent kept" in out) is (damage != "unwritable")
    if damage != "unwritable":
        assert kept.read_bytes() == data  # compiled and kept again
        assert host_call(env, request, send=False)[0]["error"]["kind"] == "StateError"
        assert not list(kept.parent.glob("*.tmp"))


def test_a_bundle_that_does_not_match_its_hash_is_neither_run_nor_kept(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    bundle = agent_bundle().replace(b"def main(", b"def main(evil=1, *, ")
    request = json.dumps({"checkout": str(tmp_path / "nope")}).encode() + b"\n"
    stdin = b"%d\n" % len(bundle) + bundle + request
    proc = subprocess.run(agent_argv(sys.executable, "status"), input=stdin, capture_output=True, env=env)
    reply = json.loads(proc.stdout.splitlines()[-1])
    assert reply["ok"] is False and "sha256" in reply["error"]["message"], reply
    assert not (tmp_path / "cache" / "ddeploy" / "agent").exists() or not list(
        (tmp_path / "cache" / "ddeploy" / "agent").iterdir()
    )


def test_a_changed_agent_source_has_another_hash():
    sources = agent_sources()
    changed = {**sources, "ddeploy_agent.common": sources["ddeploy_agent.common"] + b"# changed\n"}
    renamed = {("ddeploy_agent.other" if k == "ddeploy_agent.common" else k): v for k, v in sources.items()}
    digests = {bundle_digest(sources), bundle_digest(changed), bundle_digest(renamed)}
    assert len(digests) == 3 and agent_digest() == bundle_digest(sources)


def _git(repo, *args, input=None) -> str:
    return (
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, input=input)
        .stdout.decode()
        .strip()
    )


def test_a_noop_push_and_status_run_three_git_processes_each(tmp_path, patch_sets):
    """The agent starts on every command: a push of the set already applied reads HEAD and the state
    record with one `git cat-file --batch`, then checks the set's files (ls-tree, status); status
    adds the whole-tree status and the branch. Counted with a `git` first on PATH that logs."""
    from deployer.ops.deploy import Options, options_request, set_request
    from deployer.patchset.release import load_patch_set
    from deployer.patchset.sglang_base import clone_base

    checkout = clone_base(tmp_path / "co")
    ps = load_patch_set(str(patch_sets["v2"]))
    log, bin_dir = tmp_path / "git.log", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text('#!/bin/sh\nprintf "%%s\\n" "$4" >> %s\nexec %s "$@"\n' % (log, shutil.which("git")))
    (bin_dir / "git").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", XDG_CACHE_HOME=str(tmp_path / "cache"))

    def call(op: str, request: dict) -> tuple[dict, list[str]]:
        req = {"op": op, "checkout": str(checkout), "by": "t@x", "command": "test", **request}
        log.write_text("")
        stdin = agent_stdin(req)
        proc = subprocess.run(agent_argv(sys.executable, op), input=stdin, capture_output=True, env=env)
        return json.loads(proc.stdout.splitlines()[-1]), log.read_text().split()  # the git subcommand of each call

    sets = str(checkout / ".git" / "ddeploy" / "sets" / ps.version)
    push = options_request(Options())
    first, _ = call("push", {**push, "set": set_request(ps, remote_dir=sets, inline=True)})
    assert first["ok"] and first["changed"], first
    noop, calls = call("push", {**push, "set": set_request(ps, remote_dir=sets, inline=False)})
    assert noop["ok"] and noop["changed"] is False and noop["plan"]["action"] == "noop", noop
    assert len(calls) <= 3, calls
    status, calls = call("status", {})
    facts = status["facts"]
    assert facts["head"] == _git(checkout, "rev-parse", "HEAD") == first["applied"]["head"]
    assert facts["tree"] == _git(checkout, "rev-parse", "HEAD^{tree}") and facts["branch"] == "main"
    assert facts["state_commit"] == _git(checkout, "rev-parse", "refs/ddeploy/state")
    assert facts["state"]["applied"]["version"] == "0.2.0" and facts["drift"] == []
    assert len(calls) <= 3, calls


def test_facts_read_head_and_the_state_record_as_rev_parse_and_cat_file_would(tmp_path):
    """No record, a detached or unborn HEAD, an ambiguous branch name, a state.json that is not JSON
    or not there (facts and read_state both read HEAD and the record in one git process)."""
    from deployer.patchset.sglang_base import clone_base

    co = clone_base(tmp_path / "co")
    repo = Repo(str(co))
    head, tree = _git(co, "rev-parse", "HEAD"), _git(co, "rev-parse", "HEAD^{tree}")
    f = facts(repo)
    assert (f["head"], f["tree"], f["branch"], f["state_commit"]) == (head, tree, "main", None)
    assert f["state"] == {"schema": 1, "applied": None, "pre_deploy": None} and read_state(repo)[0] is None
    _git(co, "tag", "main")
    assert facts(repo)["branch"] == "heads/main"  # as `git symbolic-ref --short HEAD` has it
    _git(co, "checkout", "-q", "--detach")
    assert facts(repo)["branch"] is None
    update_section(repo, "tests", lambda _old: {"ok": True}, "a record")
    commit = _git(co, "rev-parse", "refs/ddeploy/state")
    assert read_state(repo) == (commit, {"schema": 1, "applied": None, "pre_deploy": None, "tests": {"ok": True}})
    assert facts(repo)["state_commit"] == commit
    for content in ("not json", None):  # a state.json that is not JSON, a record without one
        blob = _git(co, "hash-object", "-w", "--stdin", input=(content or "{}").encode())
        name = "state.json" if content else "other.json"
        record = _git(co, "mktree", input=f"100644 blob {blob}\t{name}\n".encode())
        _git(co, "update-ref", "refs/ddeploy/state", _git(co, "commit-tree", record, "-m", "bad"))
        for read in (read_state, facts):
            with pytest.raises(Fail, match=f"refs/ddeploy/state in {co} has no readable state.json"):
                read(repo)
    _git(co, "symbolic-ref", "HEAD", "refs/heads/unborn")
    with pytest.raises(Fail, match="has no commit checked out"):
        facts(repo)


def test_a_session_on_the_local_host_sends_the_agent_once_and_again_when_the_host_lost_it(tmp_path, monkeypatch):
    """AgentSession on the built-in local host: the first call sends the bundle, the client notes
    that the host keeps it, the next call names its hash only; a lost copy costs one NeedAgent."""
    from deployer.errors import StateError
    from deployer.inventory import local_host
    from deployer.transport.agent_client import agent_session, kept_marker
    from deployer.transport.connection import Connection
    from deployer.transport.protocol import StatusReply

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "host"))  # where the agent keeps itself here
    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path / "client"))
    host = local_host().model_copy(update={"checkout": str(tmp_path / "nope")})
    firsts: list[int] = []  # what each agent start sent before the request
    real = Connection.start

    def start(conn, argv, **kw):
        firsts.append(len(kw["first_input"]))
        return real(conn, argv, **kw)

    monkeypatch.setattr(Connection, "start", start)

    def status() -> list[int]:
        before = len(firsts)
        with agent_session(host) as agent, pytest.raises(StateError, match="does not exist on this host"):
            agent.call("status", {}, StatusReply)
        return firsts[before:]

    assert not kept_marker(host).exists()
    [first] = status()
    assert first > 50_000 and kept_marker(host).exists()
    assert status() == [2]  # b"0\n": the bundle stays on the host
    [kept] = (tmp_path / "host" / "ddeploy" / "agent").iterdir()
    kept.unlink()
    lost = status()
    assert lost[0] == 2 and lost[1] > 50_000 and len(lost) == 2 and kept.exists()
    assert status() == [2]


@pytest.mark.parametrize("branch", ["main", None])
def test_a_switch_moves_the_branch_or_detached_head_and_the_refs_together(tmp_path, branch):
    """transaction.finish: the work tree switched, then the branch (or, on a detached HEAD, HEAD
    itself) and the operation's refs moved in one update-ref transaction (a ref with no value is
    deleted), then the state recorded and the journal removed."""
    from deployer.agent.transaction import finish, journal_path, write_journal
    from deployer.patchset.sglang_base import clone_base

    co = clone_base(tmp_path / "co")
    repo = Repo(str(co))
    base = _git(co, "rev-parse", "HEAD")
    if branch is None:
        _git(co, "checkout", "-q", "--detach")
    path = "python/sglang/version.py"
    blob = _git(co, "hash-object", "-w", "--stdin", input=b"__version__ = 'switched'\n")
    index = {"GIT_INDEX_FILE": str(tmp_path / "index")}
    subprocess.run(["git", "-C", str(co), "read-tree", base], env={**os.environ, **index}, check=True)
    subprocess.run(
        ["git", "-C", str(co), "update-index", "--cacheinfo", f"100644,{blob},{path}"],
        env={**os.environ, **index},
        check=True,
    )
    tree = subprocess.run(
        ["git", "-C", str(co), "write-tree"], env={**os.environ, **index}, capture_output=True, text=True
    ).stdout.strip()
    target = _git(co, "commit-tree", tree, "-p", base, "-m", "target")
    _git(co, "update-ref", "refs/ddeploy/old", base)
    os.makedirs(repo.ddir, exist_ok=True)
    journal = {
        "op": "push",
        "target": target,
        "files": [path],
        "branch": branch,
        "refs": {"refs/ddeploy/pre-deploy": base, "refs/ddeploy/old": None},
        "state": {"applied": {"version": "9.9.9"}},
        "message": "push test",
    }
    write_journal(repo, journal)
    finish(repo, journal)
    assert (co / path).read_text() == "__version__ = 'switched'\n"
    assert _git(co, "rev-parse", "HEAD") == target
    if branch:
        assert _git(co, "symbolic-ref", "HEAD") == "refs/heads/main"
    else:
        assert subprocess.run(["git", "-C", str(co), "symbolic-ref", "-q", "HEAD"]).returncode == 1
        assert _git(co, "rev-parse", "refs/heads/main") == base  # the branch left alone
    assert _git(co, "rev-parse", "refs/ddeploy/pre-deploy") == base
    assert subprocess.run(["git", "-C", str(co), "rev-parse", "-q", "--verify", "refs/ddeploy/old"]).returncode == 1
    assert read_state(repo)[1]["applied"] == {"version": "9.9.9"}
    assert not os.path.exists(journal_path(repo))
    assert _git(co, "status", "--porcelain") == ""
