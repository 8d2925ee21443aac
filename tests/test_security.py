"""Security by default: shell metacharacters in paths and env values stay data on a real sshd
host and tricky patch paths are refused. (The sources' secure defaults - no shell=True, no
unsafe YAML loading, no auto-accepted host keys, no eval/exec - are ruff's security rules `S`,
run by .ci/run; see pyproject.toml.)"""

from __future__ import annotations

import re

import pytest

from deployer.transport.connection import open_connection
from deployer.errors import PathSafetyError
from deployer.inventory import Inventory
from deployer.patchset.path_safety import patch_paths


@pytest.mark.sshd
def test_metacharacters_in_cwd_env_and_argv_stay_data(sshd_fleet, tmp_path):
    marker = tmp_path / "PWNED"
    weird = tmp_path / "a b" / f"$(touch {marker})'q\"`touch {marker}`;x"
    weird.mkdir(parents=True)
    value = f'it\'s "q" $(touch {marker}) `touch {marker}` ; x'
    host = Inventory.load(sshd_fleet.inventory_dir).get("h1")
    host = host.model_copy(update={"checkout": str(weird), "env": {**host.env, "DDEPLOY_ODD": value}})
    with open_connection(host) as conn:
        assert conn.run(["pwd"], cwd=host.checkout).stdout.strip() == str(weird)
        assert conn.run(["printenv", "DDEPLOY_ODD"]).stdout == value + "\n"
        assert conn.run(["sh", "-c", 'printf %s "$1"', "sh", host.checkout]).stdout == str(weird)
        conn.run(["mkdir", f"{host.checkout}/sub dir"])
    assert (weird / "sub dir").is_dir()
    assert not marker.exists()


def _new_file(path: str, eol: str = "\n") -> bytes:
    lines = [
        f"diff --git a/{path} b/{path}",
        "new file mode 100644",
        "--- /dev/null",
        f"+++ b/{path}",
        "@@ -0,0 +1 @@",
        "+x",
        "",
    ]
    return eol.join(lines).encode()


@pytest.mark.parametrize(
    "data, words",
    [
        (_new_file("../x", "\r\n"), "escapes the checkout"),
        (_new_file("ok", "\r\n").replace(b"+++ b/ok", b"+++ b/.git/config"), "inside .git/"),
        (b"diff --git a/ok b/ok\n--- a/ok\n+++ b/../evil\n@@ -1 +1 @@\n-a\n+b\n", "escapes the checkout"),
        (b"--- a/x\n+++ b/.git/hooks/post-checkout\n@@ -1 +1 @@\n-a\n+b\n", "inside .git/"),
        (b'diff --git "a/x\\\\..\\\\y" "b/x\\\\..\\\\y"\n', "malformed path"),
        (b'diff --git "a/.G\\151T/config" "b/.G\\151T/config"\n', "inside .git/"),
        (b"diff --git a/a/../../x b/a/../../x\n", "escapes the checkout"),
        (b"diff --git a/l b/l\nindex 1234567..89abcde 120000\n--- a/l\n+++ b/l\n@@ -1 +1 @@\n-a\n+b\n", "a symlink"),
        (b"diff --git a/x b/y\nsimilarity index 100%\ncopy from x\ncopy to /etc/cron.d/x\n", "absolute path"),
        (b'diff --git a/x b/y\nrename from x\nrename to "\\056\\056/y"\n', "escapes the checkout"),
    ],
)
def test_tricky_patch_paths_are_refused(data, words):
    with pytest.raises(PathSafetyError, match=re.escape(words)) as exc:
        patch_paths(data, patch="0001-x.patch")
    assert "0001-x.patch" in str(exc.value)


def test_crlf_patch_paths_are_read_without_the_cr():
    assert patch_paths(_new_file("python/ok.py", "\r\n"), patch="p") == ["python/ok.py"]


def test_rendered_env_file_is_private(tmp_path, cli):
    """The env file may hold tokens (host env, --set env.X): only its owner reads it."""
    out = tmp_path / "out"
    r = cli("render", "--host", "rtx6000", "-t", "tp8", "--set", "env.HF_TOKEN=hf_secret", "-o", str(out))
    assert r.code == 0, r.stderr
    assert (out / "rtx6000-tp8.env").stat().st_mode & 0o777 == 0o600
    assert "hf_secret" in (out / "rtx6000-tp8.env").read_text() and "hf_secret" not in r.stderr


@pytest.mark.sshd
def test_push_and_rollback_on_a_checkout_path_full_of_metacharacters(sshd_fleet, patch_sets, tmp_path, cli):
    """The whole flow (rsync of the set, agent, git) treats an odd checkout path as data."""
    import yaml
    from deployer.patchset.sglang_base import clone_base
    from sshd_hosts import STUB

    marker = tmp_path / "PWNED"
    weird = tmp_path / "sp ace" / f"$(touch {marker})`touch {marker}`'q\";x"
    clone_base(weird)
    inv = tmp_path / "inv"
    inv.mkdir()
    doc = yaml.safe_load((sshd_fleet.inventory_dir / "h1.yaml").read_text())
    (inv / "h1.yaml").write_text(yaml.safe_dump({**doc, "checkout": str(weird)}))
    r = cli("push", "--host", "h1", "--version", str(patch_sets["v1"]), inventory=inv)
    assert r.code == 0, r.stderr
    assert (weird / STUB).read_text() == "VERSION = 1\n"
    r = cli("rollback", "--host", "h1", inventory=inv)
    assert r.code == 0, r.stderr
    assert not (weird / STUB).exists() and not marker.exists()
