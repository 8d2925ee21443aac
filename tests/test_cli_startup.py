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


def test_the_connection_master_imports_no_inventory_and_no_pydantic():
    """A first command waits for the connection master's imports before it can connect, so the
    master rebuilds its hosts as SSHEndpoints (deployer/transport/endpoint.py), not as the
    inventory's pydantic models (~0.1 s of imports)."""
    probe = "import json, sys, deployer.transport.control_master; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(json.loads(proc.stdout))
    assert "paramiko" in loaded and "fabric" in loaded  # what it does need
    assert not {"pydantic", "deployer.inventory"} & loaded, {"pydantic", "deployer.inventory"} & loaded


def test_an_endpoint_carries_what_the_ssh_layer_reads_of_a_host(tmp_path):
    from deployer.inventory import Inventory
    from deployer.transport.endpoint import SSHEndpoint, SSHOptions

    (tmp_path / "gpu1.yaml").write_text(
        "name: gpu1\nssh: {host: 10.0.0.7, user: deploy, port: 2222, identity: ~/.ssh/id_ed25519,"
        " jump: ops@bastion:22, config: ssh_config}\ngpu: {model: B300, count: 8, arch: sm_103}\n"
        "interconnect: nvlink\ncheckout: /opt/sglang\nenv: {CUDA_HOME: /usr/local/cuda}\n"
    )
    host = Inventory.load(tmp_path).get("gpu1")
    endpoint = SSHEndpoint.of(host)
    assert endpoint == SSHEndpoint(
        "gpu1",
        host.source,
        SSHOptions("10.0.0.7", "deploy", 2222, "~/.ssh/id_ed25519", "ops@bastion:22", "ssh_config"),
        {"CUDA_HOME": "/usr/local/cuda"},
    )
    assert SSHEndpoint.from_json(json.loads(json.dumps(endpoint.to_json()))) == endpoint
    assert SSHEndpoint.of(endpoint) is endpoint
