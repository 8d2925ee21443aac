"""`ddeploy patches list|show|diff` and the CI check that the released set matches the overlay."""

from __future__ import annotations

import json

import pytest

from deployer.patchset.export import export_patch_set, sync_differences
from deployer.locations import overlay_dir, patch_set_root
from deployer.patchset.release import list_versions, load_patch_set
from patchset_fixtures import patches_root, pristine_base, run_main, small_overlay  # noqa: F401


@pytest.fixture
def two_versions(small_overlay, patches_root):
    export_patch_set(small_overlay, patches_root, date="2026-11-29")
    (small_overlay / "python/ddtree_probe/__init__.py").write_text(
        (small_overlay / "python/ddtree_probe/__init__.py").read_text() + "\n\nDEFAULT_BUDGET = 64\n"
    )
    (small_overlay / "python/ddtree_probe/extra.py").write_text("X = 1\n")
    export_patch_set(small_overlay, patches_root, date="2026-11-30")
    return patches_root


def test_list_shows_versions_dates_base_and_patch_count(two_versions):
    r = run_main("patches", "list")
    assert r.code == 0
    rows = r.stderr.splitlines()
    assert rows[0].split() == ["version", "created", "base", "base", "tree", "patches"]
    assert rows[2].split() == ["0.1.0", "2026-11-29", "sglang", "0.5.23", "2013599e516e", "2"]
    assert rows[3].split()[:2] == ["0.1.1", "2026-11-30"]
    data = json.loads(run_main("patches", "list", "--json").stdout)
    assert [d["version"] for d in data] == ["0.1.0", "0.1.1"]
    assert data[1]["patches"][0]["files"] == [
        "python/ddtree_probe/__init__.py",
        "python/ddtree_probe/extra.py",
        "test/srt/ddtree/test_probe.py",
    ]


def test_show_lists_patches_concerns_files_and_sha256(two_versions):
    ps = load_patch_set("0.1.0")
    r = run_main("patches", "show", "0.1.0")
    assert r.code == 0
    assert f"0001-ddtree-builder.patch  concern=builder  sha256={ps.patches[0].sha256}" in r.stderr
    assert "    python/sglang/srt/arg_groups/speculative_hook.py" in r.stderr
    assert json.loads(run_main("patches", "show", "0.1.0", "--json").stdout)["fingerprint"] == ps.fingerprint()


def test_diff_names_the_changed_patch_and_files(two_versions):
    r = run_main("patches", "diff", "0.1.0", "0.1.1", "--stat")
    assert r.code == 0
    assert r.stderr.splitlines() == [
        "0001-ddtree-builder.patch: changed (+python/ddtree_probe/extra.py, ~python/ddtree_probe/__init__.py)",
        "0003-ddtree-wiring.patch: unchanged",
    ]
    assert r.stdout == ""
    full = run_main("patches", "diff", "0.1.0", "0.1.1")
    assert full.stdout.startswith("--- 0.1.0/0001-ddtree-builder.patch\n+++ 0.1.1/0001-ddtree-builder.patch\n")
    assert "++DEFAULT_BUDGET = 64" in full.stdout


def test_unknown_version_is_a_one_line_error(two_versions):
    r = run_main("patches", "show", "9.9.9")
    assert r.code == 4
    assert r.stderr.strip().endswith(f"patch set ddtree 9.9.9 not found under {two_versions} (released: 0.1.0, 0.1.1)")


def test_list_with_nothing_released(patches_root):
    r = run_main("patches", "list")
    assert r.code == 0 and "no released patch sets under" in r.stderr


def test_newest_released_set_is_in_sync_with_the_overlay():
    """CI: editing overlays/ddtree without `ddeploy patches export` fails here, naming what differs."""
    root = patch_set_root()
    versions = list_versions(root=root)
    if not versions:
        pytest.skip(f"no patch set released under {root} yet")
    problems = sync_differences(overlay_dir(), root / versions[-1])
    assert not problems, (
        f"overlays/ddtree differs from released patch set {versions[-1]}: "
        f"{'; '.join(problems)}. Run `ddeploy patches export` to release a new version."
    )


def test_list_reports_a_tampered_set_without_hiding_the_others(two_versions):
    patch = two_versions / "0.1.0" / "0003-ddtree-wiring.patch"
    patch.write_bytes(patch.read_bytes().replace(b"DDTree", b"DDtree", 1))
    r = run_main("patches", "list")
    assert r.code == 4
    rows = [line.split() for line in r.stderr.splitlines()]
    assert rows[2][:2] == ["0.1.1", "2026-11-30"] and rows[3][:2] == ["0.1.0", "INVALID"]
    assert "1 released set(s) failed verification: 0.1.0: patch 0003-ddtree-wiring.patch" in r.stderr
