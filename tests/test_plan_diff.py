"""`plan --diff` / `push --dry-run --diff`: per host, the unified diff push would make, computed by
the agent from the same plan push executes (real sshd hosts, real git)."""

from __future__ import annotations

import json
import subprocess

import pytest

from sshd_hosts import INIT_PY, STUB, VERSION_PY

pytestmark = pytest.mark.sshd


def git_diff(checkout, old: str, new: str) -> str:
    argv = ["git", "-C", str(checkout), "diff", "--no-color", "--no-renames", "--binary", old, new]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def host_diffs(r) -> dict:
    return {res["host"]: res["data"]["diff"] for res in json.loads(r.stdout)}


def test_the_planned_diff_is_exactly_what_push_then_changes(hosts, ddeploy, patch_sets):
    h1, h2 = hosts.hosts[:2]
    before = h1.git("for-each-ref"), h1.git("rev-parse", "HEAD"), h1.git("status", "--porcelain")
    r = ddeploy("plan", "--host", "h1", "--host", "h2", "--version", str(patch_sets["v1"]), "--diff", "--json")
    assert r.code == 0, r.stderr
    diffs = host_diffs(r)
    assert diffs["h1"]["files"] == sorted([STUB, VERSION_PY]) and not diffs["h1"]["truncated"]
    assert (h1.git("for-each-ref"), h1.git("rev-parse", "HEAD"), h1.git("status", "--porcelain")) == before
    assert ddeploy("push", "--host", "h1", "--version", str(patch_sets["v1"])).code == 0
    assert diffs["h1"]["text"] == git_diff(h1.checkout, hosts.base_commit, "HEAD")
    assert diffs["h1"]["bytes"] == len(diffs["h1"]["text"].encode())
    assert diffs["h2"]["text"] == diffs["h1"]["text"]  # same base, same series: same diff

    r = ddeploy("push", "--host", "h1", "--version", str(patch_sets["v2"]), "--dry-run", "--diff", "--json")
    assert r.code == 0, r.stderr
    diff = host_diffs(r)["h1"]
    old = h1.git("rev-parse", "HEAD")
    assert diff["files"] == sorted([INIT_PY, STUB, VERSION_PY]) and "-VERSION = 1\n+VERSION = 2\n" in diff["text"]
    assert ddeploy("push", "--host", "h1", "--version", str(patch_sets["v2"])).code == 0
    assert diff["text"] == git_diff(h1.checkout, old, "HEAD")

    r = ddeploy("plan", "--host", "h1", "--version", str(patch_sets["v2"]), "--diff", "--json")
    assert r.code == 0 and host_diffs(r)["h1"] == {
        "files": [],
        "text": "",
        "bytes": 0,
        "truncated": False,
        "note": None,
    }
    assert "no change (ddtree 0.2.0 already applied); diff: 0 file(s)" in r.stderr


def test_human_diff_goes_to_stdout_per_host_without_colour_off_a_terminal(hosts, ddeploy, patch_sets):
    r = ddeploy("plan", "--host", "h1", "--version", str(patch_sets["v1"]), "--diff")
    assert r.code == 0, r.stderr
    assert r.stdout.startswith("# h1: 2 file(s) would change\n")
    assert f"+++ b/{STUB}\n" in r.stdout and "+VERSION = 1\n" in r.stdout and "\x1b[" not in r.stdout
    assert "would apply ddtree 0.1.0 (2 patches, 2 files); diff: 2 file(s)" in r.stderr
    plain = ddeploy("plan", "--host", "h1", "--version", str(patch_sets["v1"]))
    assert plain.code == 0 and plain.stdout == "" and "diff:" not in plain.stderr


def test_a_series_that_does_not_apply_has_no_diff_and_the_plan_fails(hosts, ddeploy, patch_sets):
    h3 = hosts.hosts[2]
    (h3.checkout / VERSION_PY).write_text("a different version file\n")
    h3.git("commit", "-q", "-am", "local change the wiring patch does not expect")
    r = ddeploy("plan", "--host", "h3", "--version", str(patch_sets["v1"]), "--diff", "--3way", "--json")
    [res] = json.loads(r.stdout)
    assert r.code == 0 and res["data"]["diff"]["text"] is None, r.stderr
    assert res["data"]["diff"]["note"].startswith("no diff: the series does not apply on ")
    r = ddeploy("plan", "--host", "h3", "--version", str(patch_sets["v1"]), "--diff")
    assert r.code != 0 and "[h3] FAILED" in r.stderr and r.stdout == ""  # push would refuse: no diff shown


def test_a_diff_over_the_limit_is_cut_at_a_line_end_and_says_so(hosts, ddeploy, tmp_path):
    from sshd_hosts import make_patch_set

    big = "".join(f"LINE_{i} = {i}\n" for i in range(50000))  # ~0.7 MB of new file
    set_dir = make_patch_set(tmp_path / "0.9.0", "0.9.0", [("builder", {STUB: big})])
    r = ddeploy("plan", "--host", "h1", "--version", str(set_dir), "--diff", "--json")
    assert r.code == 0, r.stderr
    diff = host_diffs(r)["h1"]
    text = diff["text"]
    assert diff["truncated"] and diff["bytes"] > len(text.encode()) and len(text.encode()) <= 512 * 1024
    assert text.endswith("\n") and text.splitlines()[-1].startswith("+LINE_")
    assert f"diff: 1 file(s), cut at {len(text.encode())} of {diff['bytes']} bytes" in r.stderr
