"""The host-side agent must run on a plain host: Python >= 3.8 syntax and the standard library only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from deployer.remote import AGENT_PATH, MAX_SOURCE, agent_source


def test_agent_is_python38_syntax_and_stdlib_only():
    src = agent_source()
    assert len(src) < MAX_SOURCE
    tree = ast.parse(src, feature_version=(3, 8))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_agent_reports_errors_as_json_not_tracebacks(tmp_path):
    proc = subprocess.run([sys.executable, str(AGENT_PATH), "status"], capture_output=True, text=True,
                          input=json.dumps({"checkout": str(tmp_path / "nope")}))
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"] is False
    assert result["error"]["kind"] == "StateError" and "does not exist on this host" in result["error"]["message"]
    proc = subprocess.run([sys.executable, str(AGENT_PATH), "explode"], capture_output=True, text=True,
                          input=json.dumps({"checkout": str(tmp_path)}))
    assert json.loads(proc.stdout)["error"]["kind"] == "UsageError"
