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


def test_a_console_run_ends_like_sys_exit_without_the_teardown():
    """main() ends a console run with os._exit: thread exit hooks (an executor never shut down),
    atexit handlers and buffered output must all still happen, and the exit status be kept."""
    code = """
import atexit, concurrent.futures, sys
from deployer.cli import _leave
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(print, "from a worker").result()
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("buffered, not flushed")
_leave(7)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7
    assert proc.stdout.splitlines() == ["from a worker", "buffered, not flushedatexit ran"]


def test_paramiko_imports_without_importlib_metadata_and_knows_its_version():
    """deployer.transport.ssh_config imports paramiko with a stand-in for importlib.metadata that
    reads only paramiko's own version; afterwards the real module is what `import` gives."""
    code = """
import json, sys
import deployer.transport.ssh_config as c
during = "importlib.metadata" in sys.modules
import importlib.metadata as m
print(json.dumps([during, c.paramiko.__version__, m.version("paramiko"), m.version("click"), m.__file__]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    during, own, real, click_version, path = json.loads(proc.stdout)
    assert not during  # nothing imported the real module
    assert own == real and click_version  # the same version; the real module answers for others
    assert path.endswith("importlib/metadata/__init__.py")
