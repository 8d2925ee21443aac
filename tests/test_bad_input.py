"""Bad input of any kind gets one `ddeploy: error: ...` line naming what and where, a non-zero
exit and no traceback: inventory files, patch-set directories, CLI arguments, unreachable hosts,
a host that never sends an SSH banner, and a host whose python replies with junk.

None of these tests needs an SSH server; each runs the real CLI in-process.
"""

from __future__ import annotations

import socket
import threading

import pytest
import yaml

GOOD = {
    "name": "g1",
    "ssh": {"host": "127.0.0.1", "port": 22},
    "gpu": {"model": "x", "count": 8, "arch": "sm_120"},
    "interconnect": "pcie",
    "checkout": "/opt/sglang",
}


def one_error_line(r) -> str:
    """The run failed with exactly one `ddeploy: error:` line as its last line, and no traceback."""
    assert r.code != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("ddeploy: error: "), r.stderr
    assert sum(ln.startswith("ddeploy: error: ") for ln in lines) == 1, r.stderr
    return lines[-1]


def inventory(tmp_path, text: str | bytes, name: str = "h.yaml"):
    inv = tmp_path / "inv"
    inv.mkdir(exist_ok=True)
    path = inv / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return inv, path


def with_change(**change) -> str:
    doc = {**GOOD}
    for dotted, value in change.items():
        *parents, leaf = dotted.split("__")
        node = doc
        for p in parents:
            node[p] = dict(node[p])
            node = node[p]
        node[leaf] = value
    return yaml.safe_dump(doc)


# -- inventory files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expect",
    [
        ("name: [a", "not valid YAML"),
        ("- a\n- b\n", "a host must be a mapping, got list"),
        ("hello\n", "a host must be a mapping, got str"),
        ("hosts: 3\n", "'hosts' must be a list"),
        (b"name: \xff\n", "not UTF-8 text"),
        (with_change() + "name: g2\n", "duplicate key 'name'"),
        ("hosts:\n  - {name: a, name: b}\n", "duplicate key 'name'"),
        (with_change(colour="red"), "field colour: Extra inputs are not permitted"),
        (with_change(gpu__count="many"), "field gpu.count"),
        (with_change(gpu__count=True), "field gpu.count: True is not a number"),
        (with_change(gpu__arch="sm_1x"), "field gpu.arch: 'sm_1x' is not a CUDA arch"),
        (with_change(ssh__port=0), "field ssh.port: Input should be greater than or equal to 1"),
        (with_change(ssh__port=70000), "field ssh.port: Input should be less than or equal to 65535"),
        (with_change(ssh__port="abc"), "field ssh.port: Input should be a valid integer"),
        (with_change(ssh__port=True), "field ssh.port: True is not a number"),
        (with_change(name="g1;rm -rf"), "field name:"),
        (with_change(name="g 1"), "field name:"),
        (with_change(env={"A": 1}), "field env.A: Input should be a valid string"),
        (with_change(env={"A B": "x"}), "environment name 'A B' is not a valid variable name"),
        (with_change(name="g1\n"), "field name: 'g1\\n' must be letters"),
        (with_change(gpu__arch="sm_120\n"), "field gpu.arch: 'sm_120\\n' is not a CUDA arch"),
        (with_change(env={"A\n": "x"}), "environment name 'A\\n' is not a valid variable name"),
        (with_change(checkout="~/sglang"), "field checkout: '~/sglang' must be an absolute path"),
        (with_change(checkout="sglang"), "field checkout: 'sglang' must be an absolute path"),
        (with_change(checkout="/opt/a\nb"), "field checkout: '/opt/a\\nb' contains a newline or control character"),
    ],
)
def test_bad_host_file_is_one_line_naming_file_and_field(tmp_path, cli, text, expect):
    inv, path = inventory(tmp_path, text)
    line = one_error_line(cli("hosts", inventory=inv))
    assert str(path) in line and expect in line
    assert cli("hosts", inventory=inv).code == 3


def test_odd_but_valid_host_values_are_kept_verbatim(tmp_path, cli):
    """Spaces, quotes and $(...) in a checkout or env value are data (quoted on the host), not refused."""
    weird = "/opt/a b/$(touch x)'q\""
    inv, _ = inventory(tmp_path, with_change(checkout=weird, env={"A": 'it\'s "q" $(x)'}))
    r = cli("hosts", "--json", inventory=inv)
    assert r.code == 0, r.stderr
    host = next(h for h in yaml.safe_load(r.stdout) if h["name"] == "g1")
    assert host["checkout"] == weird and host["env"] == {"A": 'it\'s "q" $(x)'}


def test_empty_host_file_adds_no_host(tmp_path, cli):
    inv, _ = inventory(tmp_path, "")
    r = cli("hosts", inventory=inv)
    assert r.code == 0 and "g1" not in r.stderr and "local" in r.stderr


def test_duplicate_host_across_files_names_both(tmp_path, cli):
    inv, a = inventory(tmp_path, with_change(), "a.yaml")
    _, b = inventory(tmp_path, with_change(), "b.yml")
    line = one_error_line(cli("hosts", inventory=inv))
    assert f"{b}: host 'g1' is also defined in {a}" in line


def test_local_may_be_replaced_once_but_not_twice(tmp_path, cli):
    local = {**GOOD, "name": "local", "connection": "local"}
    del local["ssh"]
    inv, a = inventory(tmp_path, yaml.safe_dump(local), "a.yaml")
    assert cli("hosts", inventory=inv).code == 0
    _, b = inventory(tmp_path, yaml.safe_dump(local), "b.yaml")
    line = one_error_line(cli("hosts", inventory=inv))
    assert f"{b}: host 'local' is also defined in {a}" in line


def test_missing_inventory_dir(tmp_path, cli):
    line = one_error_line(cli("hosts", inventory=tmp_path / "nope"))
    assert f"inventory directory {tmp_path / 'nope'} does not exist" in line


# -- host selection ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, code, expect",
    [
        (["status", "--host", "nope"], 3, "unknown host 'nope' (known: g1, local)"),
        (["status", "--group", "nope"], 3, "unknown or empty group 'nope'"),
        (["status"], 2, "choose hosts with --host NAME, --group G or --all"),
        (["status", "--host", "g1", "--all"], 2, "--all already selects every host; drop --host/--group"),
        (["build", "--group", "local", "--all"], 2, "--all already selects every host"),
        (["push", "--host", "g1", "--version", "9.9.9"], 4, "patch set ddtree 9.9.9 not found"),
        (["patches", "diff", "9.9.8", "9.9.9"], 4, "patch set ddtree 9.9.8 not found"),
        (["patches", "show", "nope"], 4, "patch set 'nope' is neither a released version nor a directory"),
    ],
)
def test_bad_selection_or_version(tmp_path, cli, monkeypatch, args, code, expect):
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(tmp_path / "released"))
    inv, _ = inventory(tmp_path, with_change())
    r = cli(*args, inventory=inv)
    assert expect in one_error_line(r) and r.code == code


# -- render / launch --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, expect",
    [
        ("garbage", "malformed --set 'garbage': expected key=value"),
        ("=x", "malformed --set '=x'"),
        ("bogus=1", "--set: unknown key 'bogus'"),
        ("port=abc", "--set: port='abc': expected an integer"),
        ("port=70000", "port must be a TCP port in 1..65535 (got 70000)"),
        ("port=0", "port must be a TCP port in 1..65535 (got 0)"),
        ("model_path=x\nrm -rf ~", "--set: model_path='x\\nrm -rf ~': must be one line"),
        ("env.FOO=a\rb", "--set: env.FOO='a\\rb': must be one line"),
    ],
)
def test_render_set_garbage(tmp_path, cli, setting, expect):
    inv, _ = inventory(tmp_path, with_change())
    r = cli("render", "--host", "g1", "-t", "tp8", "--set", setting, inventory=inv)
    assert expect in one_error_line(r) and r.stdout == ""


def test_render_quotes_odd_values_without_refusing_them(tmp_path, cli):
    inv, _ = inventory(tmp_path, with_change())
    r = cli("render", "--host", "g1", "-t", "tp8", "--set", "model_path=$(rm -rf /)'x", inventory=inv)
    assert r.code == 0, r.stderr
    assert "  --model-path '$(rm -rf /)'\"'\"'x' \\" in r.stdout


def test_render_to_unwritable_dir(tmp_path, cli):
    inv, _ = inventory(tmp_path, with_change())
    r = cli("render", "--host", "g1", "-t", "tp8", "-o", "/proc/ddeploy-nope", inventory=inv)
    assert "cannot write launch scripts to /proc/ddeploy-nope" in one_error_line(r) and r.code == 9


def test_launch_checks_topology_before_contacting_the_host(tmp_path, cli):
    inv, _ = inventory(tmp_path, with_change(ssh__port=1))  # nothing listens there
    r = cli("launch", "--host", "g1", "-t", "nope", inventory=inv)
    assert "unknown topology 'nope'" in one_error_line(r) and "unreachable" not in r.stderr


# -- patch-set directories --------------------------------------------------------------------

MANIFEST = "name: ddtree\nversion: 0.1.0\nbase: {sglang: 0.5.23, tree: x}\npatches: [{name: p.patch, sha256: x}]\n"


@pytest.mark.parametrize(
    "files, expect",
    [
        ({}, "manifest.yaml: missing manifest"),
        ({"manifest.yaml": "name: ["}, "manifest.yaml: not valid YAML"),
        ({"manifest.yaml": "- 1\n"}, "manifest.yaml: expected a mapping at the top level"),
        ({"manifest.yaml": b"\xff\xfe"}, "manifest.yaml: cannot read the manifest (not UTF-8 text)"),
        ({"manifest.yaml/": None}, "manifest.yaml: cannot read the manifest (Is a directory)"),
        ({"manifest.yaml": MANIFEST}, "series: missing series file"),
        ({"manifest.yaml": MANIFEST, "series": b"\xff"}, "series: cannot read the series file (not UTF-8 text)"),
        ({"manifest.yaml": MANIFEST, "series": "p.patch\n"}, "patch p.patch listed in series is missing"),
        ({"manifest.yaml": MANIFEST, "series": "q.patch\n"}, "series ['q.patch'] does not match manifest patches"),
    ],
)
def test_broken_patch_set_dir(tmp_path, cli, files, expect):
    d = tmp_path / "set"
    d.mkdir()
    for name, content in files.items():
        if name.endswith("/"):
            (d / name.rstrip("/")).mkdir()
        else:
            (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    r = cli("patches", "verify", str(d))
    assert expect in one_error_line(r) and r.code == 4


# -- unreachable and hostile hosts ------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


def test_closed_port_is_unreachable(tmp_path, cli):
    inv, _ = inventory(tmp_path, with_change(ssh__port=_closed_port()))
    r = cli("status", "--host", "g1", inventory=inv)
    assert "1 of 1 host(s) failed: g1" in one_error_line(r) and r.code == 5
    assert "is unreachable (connection refused)" in r.stderr


@pytest.fixture
def silent_server():
    """Accepts TCP connections and never says anything (no SSH banner)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    held = []

    def accept_silently():
        try:
            while True:
                held.append(srv.accept())
        except OSError:  # the fixture closed the server
            pass

    threading.Thread(target=accept_silently, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()
    for conn, _ in held:
        conn.close()


def test_host_that_sends_no_banner_times_out_with_one_line(tmp_path, cli, monkeypatch, silent_server):
    monkeypatch.setenv("DDEPLOY_BANNER_TIMEOUT", "1")
    inv, _ = inventory(tmp_path, with_change(ssh__port=silent_server))
    r = cli("status", "--host", "g1", inventory=inv)
    assert "1 of 1 host(s) failed: g1" in one_error_line(r) and r.code == 5
    assert "accepted TCP but sent no SSH banner" in r.stderr


def test_missing_identity_file_is_named(tmp_path, cli, silent_server):
    key = tmp_path / "no_such_key"
    inv, path = inventory(tmp_path, with_change(ssh__port=silent_server, ssh__identity=str(key)))
    r = cli("status", "--host", "g1", inventory=inv)
    one_error_line(r)
    assert f"identity file {key} (ssh.identity in {path}) does not exist" in r.stderr and r.code == 5


@pytest.mark.parametrize(
    "reply, expect",
    [
        ("{not json", "replied with something that is not a JSON object: '{not json'"),
        ('{"ok": false, "error": "str"}', "unknown agent error"),
        ('{"ok": true}', "replied without 'entries'"),
    ],
)
def test_host_python_replying_junk(tmp_path, cli, reply, expect):
    fake = tmp_path / "python"
    # reads the first line of what it is sent (the client keeps stdin open until the reply), replies junk
    fake.write_text(f"#!/bin/sh\nhead -n 1 >/dev/null\nprintf '%s\\n' '{reply}'\n")
    fake.chmod(0o755)
    (tmp_path / "co").mkdir()
    doc = {**GOOD, "connection": "local", "python": str(fake), "checkout": str(tmp_path / "co")}
    del doc["ssh"]
    inv, _ = inventory(tmp_path, yaml.safe_dump(doc))
    r = cli("log", "--host", "g1", inventory=inv)
    one_error_line(r)
    assert expect in r.stderr and "internal error" not in r.stderr


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_bad_timeout_setting_is_named(tmp_path, cli, monkeypatch, value):
    monkeypatch.setenv("DDEPLOY_CONNECT_TIMEOUT", value)
    inv, _ = inventory(tmp_path, with_change(ssh__port=_closed_port()))
    r = cli("status", "--host", "g1", inventory=inv)
    one_error_line(r)
    assert f"DDEPLOY_CONNECT_TIMEOUT={value!r} is not a number of seconds (must be positive and finite)" in r.stderr
    assert r.code == 5
    assert "internal error" not in r.stderr


@pytest.mark.parametrize("version", ["0.1.0\n", "1.2", "../../x"])
def test_export_refuses_a_malformed_version_before_writing(tmp_path, cli, monkeypatch, version):
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(tmp_path / "released"))
    r = cli("patches", "export", "--version", version)
    assert f"version {version!r} must look like MAJOR.MINOR.PATCH" in one_error_line(r) and r.code == 2
    assert not (tmp_path / "released").exists()


@pytest.mark.parametrize(
    "config, expect",
    [
        (b"Host *\n  ProxyCommand\n", "ConfigParseError: Unparsable line ProxyCommand"),
        (b"Host *\n  Port abc\n", "ValueError: invalid literal for int()"),
        (b"\xff\xfe", "UnicodeDecodeError"),
    ],
)
def test_broken_ssh_config_is_named_not_an_internal_error(tmp_path, cli, config, expect):
    inv, _ = inventory(tmp_path, with_change(ssh={"host": "127.0.0.1", "config": "cfg"}))
    (inv / "cfg").write_bytes(config)
    r = cli("status", "--host", "g1", inventory=inv)
    one_error_line(r)
    assert f"ssh_config {inv / 'cfg'} cannot be used for 127.0.0.1: {expect}" in r.stderr and r.code == 5
    assert "internal error" not in r.stderr and "no: ssh_config" in r.stderr  # shown as unreachable
