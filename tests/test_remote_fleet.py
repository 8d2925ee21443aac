"""Several hosts at once, host keys through the CLI, ProxyJump, the built-in local host, inventory."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from sshd_hosts import STUB

pytestmark = pytest.mark.sshd


def test_three_hosts_in_parallel_one_down(hosts, ddeploy, patch_sets):
    hosts.hosts[2].stop()
    r = ddeploy("push", "--all", "--parallel", "3", "--version", str(patch_sets["v1"]), "--json")
    assert r.code == 5, r.stderr  # the only failure is a ConnectError: its exit code
    results = {x["host"]: x for x in json.loads(r.stdout)}
    assert [results[h]["ok"] for h in ("h1", "h2", "h3")] == [True, True, False]
    assert results["h3"]["error"]["type"] == "ConnectError" and "unreachable" in results["h3"]["error"]["message"]
    for h in hosts.hosts[:2]:
        assert (h.checkout / STUB).read_text() == "VERSION = 1\n"
    summary = r.stderr[r.stderr.index("host  result") :]
    assert "h1    ok: applied ddtree 0.1.0" in summary and "h3    FAILED: " in summary
    assert "ddeploy: error: 1 of 3 host(s) failed: h3" in r.stderr


def test_fail_fast_starts_no_new_host_after_a_failure(hosts, ddeploy, patch_sets):
    hosts.hosts[0].stop()
    r = ddeploy("push", "--all", "--parallel", "1", "--fail-fast", "--version", str(patch_sets["v1"]), "--json")
    assert r.code != 0
    status = [x["status"] for x in json.loads(r.stdout)]
    assert status == ["failed", "skipped", "skipped"]
    assert hosts.hosts[1].git("rev-parse", "HEAD") == hosts.base_commit


def test_group_selection_and_status_of_a_down_host(hosts, ddeploy, patch_sets):
    hosts.hosts[1].stop()
    r = ddeploy("status", "--group", "test", "--json")
    assert r.code == 5
    rows = {x["host"]: x for x in json.loads(r.stdout)}
    assert rows["h1"]["ok"] and not rows["h2"]["ok"] and rows["h3"]["ok"]
    assert "h2    no: root@127.0.0.12" in r.stderr and "is unreachable" in r.stderr


def test_changed_host_key_refused_by_push(hosts, ddeploy, patch_sets):
    hosts.hosts[1].rotate_host_key()
    r = ddeploy("push", "--host", "h2", "--accept-new-host-keys", "--version", str(patch_sets["v1"]))
    assert r.code == 5 and "CHANGED (possible man-in-the-middle)" in r.stderr
    assert hosts.hosts[1].git("rev-parse", "HEAD") == hosts.base_commit


def test_unknown_host_key_needs_the_opt_in(hosts, ddeploy, patch_sets):
    hosts.forget_host_key(hosts.hosts[0])
    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert r.code == 5 and "--accept-new-host-keys" in r.stderr
    assert hosts.hosts[0].git("rev-parse", "HEAD") == hosts.base_commit
    r = ddeploy("push", "--host", "h1", "--accept-new-host-keys", "--version", str(patch_sets["v1"]))
    assert r.code == 0, r.stderr
    assert f"[127.0.0.11]:{hosts.hosts[0].port}" in hosts.known_hosts.read_text()
    assert (hosts.hosts[0].checkout / STUB).exists()


def test_push_through_a_proxyjump(hosts, patch_sets, tmp_path, cli):
    inv = tmp_path / "inv"
    inv.mkdir()
    doc = yaml.safe_load((hosts.inventory_dir / "h3.yaml").read_text())
    doc["name"], doc["ssh"]["host"] = "h3-jumped", "h3-via-h1"
    (inv / "h3-jumped.yaml").write_text(yaml.safe_dump(doc))
    r = cli("push", "--host", "h3-jumped", "--version", str(patch_sets["v1"]), inventory=inv)
    assert r.code == 0, r.stderr
    assert (hosts.hosts[2].checkout / STUB).read_text() == "VERSION = 1\n"
    assert (hosts.hosts[2].checkout / ".git" / "ddeploy" / "sets").is_dir()  # rsync went through the jump too


def test_local_host_checkout_is_made_from_the_base_on_first_use(hosts, patch_sets, cli):
    from deployer.inventory import local_host

    checkout = local_host().checkout
    shutil.rmtree(checkout, ignore_errors=True)
    r = cli("push", "--host", "local", "--version", str(patch_sets["v1"]), inventory=hosts.inventory_dir)
    assert r.code == 0, r.stderr
    from pathlib import Path

    assert (Path(checkout) / STUB).read_text() == "VERSION = 1\n"
    r = cli("rollback", "--host", "local", inventory=hosts.inventory_dir)
    assert r.code == 0 and not (Path(checkout) / STUB).exists()


def test_hosts_lists_inventory_and_selection_errors(hosts, ddeploy):
    r = ddeploy("hosts", "--json")
    names = [h["name"] for h in json.loads(r.stdout)]
    assert names == ["local", "h1", "h2", "h3"]
    r = ddeploy("hosts")
    assert "h2" in r.stderr and "sm_103" in r.stderr and "nvlink" in r.stderr
    assert ddeploy("status").code == 2
    r = ddeploy("status", "--host", "nope")
    assert r.code == 3 and "unknown host 'nope'" in r.stderr
