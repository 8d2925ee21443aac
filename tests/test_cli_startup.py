"""`ddeploy --version` and `--help` import only what they use: no SSH, schema, template or YAML
library (what made them take ~0.4 s); bench/bench_push.py prints the actual start-up times."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = {"paramiko", "fabric", "invoke", "pydantic", "jinja2", "yaml"}
PROBE = """
import json, sys
from deployer.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""


@pytest.mark.parametrize(
    "args, also_absent", [(["--version"], {"click"}), (["--help"], set()), (["push", "--help"], set())]
)
def test_version_and_help_import_no_heavy_library(args, also_absent):
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True)
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert not (HEAVY | also_absent) & loaded, (HEAVY | also_absent) & loaded
    assert "ddeploy" in proc.stdout
