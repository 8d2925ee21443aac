"""The host-side agent must run on a plain host: Python >= 3.8 syntax and the standard library only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time

import pytest

from deployer.transport.agent_client import AGENT_PATH, BOOT, BOOTSTRAP, agent_argv, agent_source, agent_stdin


@pytest.mark.parametrize("part", ["agent", "boot program", "bootstrap"])
def test_agent_is_python38_syntax_and_stdlib_only(part):
    src = {"agent": agent_source().decode(), "boot program": BOOT.decode(), "bootstrap": BOOTSTRAP}[part]
    tree = ast.parse(src, feature_version=(3, 8))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_agent_reports_errors_as_json_not_tracebacks(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(AGENT_PATH), "status"],
        capture_output=True,
        text=True,
        input=json.dumps({"checkout": str(tmp_path / "nope")}),
    )
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"] is False
    assert result["error"]["kind"] == "StateError" and "does not exist on this host" in result["error"]["message"]
    proc = subprocess.run(
        [sys.executable, str(AGENT_PATH), "explode"],
        capture_output=True,
        text=True,
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
    """argv is only `python -S -c BOOTSTRAP OP` (what `ps` on the host shows): one fixed line;
    the source and the request come on stdin."""
    secret = str(tmp_path / "nope-a-path-only-in-the-request")
    argv = agent_argv(sys.executable, "status")
    assert argv == [sys.executable, "-S", "-c", BOOTSTRAP, "status"] and len(BOOTSTRAP) < 100
    proc = subprocess.run(argv, input=agent_stdin({"checkout": secret}), capture_output=True)
    result = json.loads(proc.stdout)
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
    assert json.loads(out)["error"]["message"].startswith(f"{checkout} is not a git checkout")
    proc = subprocess.run(argv, input=agent_stdin(), capture_output=True, timeout=30)
    reply = json.loads(proc.stdout)
    assert proc.returncode == 0 and reply["ok"] is False and "JSONDecodeError" in reply["error"]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["co"] and not list(checkout.iterdir())


def test_agent_bytecode_is_cached_per_source_and_a_damaged_cache_is_rebuilt(tmp_path):
    """`python -S -c BOOTSTRAP` as on a host: the first call stores the bytecode, later calls load it; a
    truncated file is compiled again and replaced."""
    env = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def status() -> dict:
        stdin = agent_stdin({"checkout": str(tmp_path / "nope")})
        proc = subprocess.run(agent_argv(sys.executable, "status"), input=stdin, capture_output=True, env=env)
        return json.loads(proc.stdout)

    assert status()["error"]["kind"] == "StateError"
    [cached] = (tmp_path / "cache" / "ddeploy" / "agent").iterdir()
    assert cached.suffix == ".marshal" and cached.stat().st_size > 10_000
    assert oct((tmp_path / "cache" / "ddeploy" / "agent").stat().st_mode & 0o777) == "0o700"
    cached.write_bytes(cached.read_bytes()[:100])  # a cut-off write
    assert status()["error"]["kind"] == "StateError"
    assert cached.stat().st_size > 10_000 and not list(cached.parent.glob("*.tmp"))
