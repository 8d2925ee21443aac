"""Inventory: validation errors name file, host and field; selection; the shipped host files."""

from __future__ import annotations

import json

import pytest
import yaml

from deployer.errors import InventoryError
from deployer.inventory import Inventory
from deployer.locations import HOSTS_DIR

GOOD = {
    "name": "gpu1",
    "ssh": {"host": "10.0.0.5", "user": "ubuntu"},
    "gpu": {"model": "NVIDIA B300 SXM6", "count": 8, "arch": "sm_103"},
    "interconnect": "nvlink",
    "checkout": "/opt/sglang",
    "groups": ["b300"],
}


def write(tmp_path, name, doc):
    (tmp_path / name).write_text(yaml.safe_dump(doc))


def test_shipped_hosts_are_valid():
    inv = Inventory.load(HOSTS_DIR)
    assert {"rtx6000", "b300", "local"} <= set(inv.hosts)
    assert inv.get("rtx6000").gpu.arch == "sm_120" and inv.get("rtx6000").interconnect == "pcie"
    assert inv.get("b300").gpu.arch == "sm_103" and inv.get("b300").interconnect == "nvlink"
    assert inv.get("local").is_local


@pytest.mark.parametrize(
    "change, field",
    [
        ({"gpu": {**GOOD["gpu"], "arch": "103"}}, "gpu.arch"),
        ({"interconnect": "infiniband"}, "interconnect"),
        ({"ssh": {"host": "-oProxyCommand=evil"}}, "ssh.host"),
        ({"gpu": {**GOOD["gpu"], "count": 0}}, "gpu.count"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_errors_name_file_host_and_field(tmp_path, change, field):
    write(tmp_path, "gpu1.yaml", {**GOOD, **change})
    with pytest.raises(InventoryError) as exc:
        Inventory.load(tmp_path)
    msg = str(exc.value)
    assert "gpu1.yaml" in msg and "host 'gpu1'" in msg and f"field {field}" in msg


def test_selection_by_name_group_and_all(tmp_path):
    write(tmp_path, "a.yaml", GOOD)
    write(tmp_path, "b.yaml", {**GOOD, "name": "gpu2", "groups": ["b300", "canary"]})
    inv = Inventory.load(tmp_path)
    assert [h.name for h in inv.select(groups=["b300"])] == ["gpu1", "gpu2"]
    assert [h.name for h in inv.select(names=["gpu2"], groups=["canary"])] == ["gpu2"]
    assert [h.name for h in inv.select(all_hosts=True)] == ["gpu1", "gpu2"]
    with pytest.raises(InventoryError, match="unknown or empty group 'nope'"):
        inv.select(groups=["nope"])


def test_inventory_level_ssh_config_is_used(tmp_path, monkeypatch):
    from deployer.transport.ssh import runtime_ssh_config

    monkeypatch.delenv("DDEPLOY_SSH_CONFIG", raising=False)
    write(tmp_path, "a.yaml", GOOD)
    assert runtime_ssh_config(Inventory.load(tmp_path).get("gpu1")) is None  # the user's and the system's
    (tmp_path / "ssh_config").write_text("Host gpu1\n  HostName 10.0.0.9\n")
    assert runtime_ssh_config(Inventory.load(tmp_path).get("gpu1")) == tmp_path / "ssh_config"
    write(tmp_path, "a.yaml", {**GOOD, "ssh": {"host": "gpu1", "config": "other_config"}})
    (tmp_path / "other_config").write_text("")
    assert runtime_ssh_config(Inventory.load(tmp_path).get("gpu1")) == tmp_path / "other_config"


@pytest.fixture
def new_user(tmp_path, monkeypatch):
    """A machine with no inventory anywhere: an empty working directory and home, no checkout."""
    for name in ("DDEPLOY_HOSTS_DIR", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DDEPLOY_PROJECT_ROOT", str(tmp_path / "no-checkout"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_hosts_without_an_inventory_lists_local_and_says_where_one_is_read(new_user, cli):
    run_cli = cli
    r = run_cli("hosts")
    assert r.code == 0, r.stderr
    assert f"first of {new_user / 'hosts'}, {new_user / 'home' / '.config' / 'ddeploy' / 'hosts'}" in r.stderr
    assert "`ddeploy init`" in r.stderr and "\nlocal  (this machine)" in r.stderr
    r = run_cli("hosts", "--json")
    assert r.code == 0 and [h["name"] for h in json.loads(r.stdout)] == ["local"]
    r = run_cli("push", "--host", "gpu1")  # other commands still need an inventory
    assert r.code == 3 and "no inventory: none of" in r.stderr


def test_init_writes_a_commented_example_that_becomes_a_valid_host(new_user, cli):
    run_cli = cli
    r = run_cli("init")
    example = new_user / "hosts" / "_example.yaml"
    assert r.code == 0 and str(example) in r.stderr, r.stderr
    text = example.read_text()
    assert text.startswith("# An example ddeploy host") and text.count("#") > 15
    assert [h.name for h in Inventory.load(new_user / "hosts").hosts.values()] == ["local"]  # `_`: ignored
    (new_user / "hosts" / "gpu1.yaml").write_text(text)
    gpu1 = Inventory.load(new_user / "hosts").get("gpu1")
    assert (gpu1.ssh.host, gpu1.gpu.arch, gpu1.checkout) == ("gpu1.example.internal", "sm_120", "/opt/sglang")
    r = run_cli("init")  # never overwrites
    assert r.code == 2 and "exists" in r.stderr and example.read_text() == text
    r = run_cli("-i", str(new_user / "inv"), "init")
    assert r.code == 0 and (new_user / "inv" / "_example.yaml").is_file()
