"""`ddeploy patches verify`: strict apply on a base clone, reverse check, overlay tests in the tree."""

from __future__ import annotations

import subprocess

import pytest

from deployer.patchset.export import export_patch_set
from deployer.patchset.local_git import FIXED_IDENTITY, git, git_out
from deployer.patchset.release import load_patch_set
from deployer.locations import overlay_dir
from deployer.patchset import verify as verify_module
from deployer.patchset.verify import verify_patch_set
from patchset_fixtures import make_overlay, patches_root, pristine_base, run_main, small_overlay  # noqa: F401

SPEC = "python/sglang/srt/arg_groups/fields/spec.py"


@pytest.mark.slow  # several seconds: a full verify / base rebuild
def test_verify_applies_cleanly_confirms_and_runs_the_tests_from_the_patched_tree(small_overlay, patches_root):
    export_patch_set(small_overlay, patches_root, date="2026-11-29")
    r = run_main("patches", "verify")
    assert r.code == 0, r.stderr
    lines = r.stderr.splitlines()
    assert "0001-ddtree-builder.patch: clean" in lines and "0003-ddtree-wiring.patch: clean" in lines
    assert "git apply -R --check: every patch applied; reversed to the base tree exactly" in lines
    # The probe test asserts ddtree_probe was imported from <clone>/python, not from the overlay.
    assert "overlay tests in the patched tree: 2 passed" in r.stderr
    assert lines[-1] == "ddtree/0.1.0: OK"


def test_verify_without_sglangs_runtime_refuses_up_front_naming_what_is_missing(
    small_overlay, patches_root, monkeypatch
):
    """The light venv lacks SGLang's runtime: one line and the fix, not a KeyError from its package init."""
    from deployer.patchset import verify

    export_patch_set(small_overlay, patches_root, date="2026-11-29")
    monkeypatch.setattr(verify, "SGLANG_RUNTIME", ("numpy", "ddeploy_no_such_package"))
    r = run_main("patches", "verify")
    assert r.code == 2, r.stderr
    assert "lacks its runtime packages: ddeploy_no_such_package; run `bash scripts/setup-venv.sh --full`" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert run_main("patches", "verify", "--no-tests").code == 0  # the rest of verify needs none of it


@pytest.mark.slow  # several seconds: a full verify / base rebuild
def test_failing_overlay_tests_fail_verify(tmp_path, patches_root):
    overlay = make_overlay(tmp_path / "overlay", expected=6)
    export_patch_set(overlay, patches_root, date="2026-11-29")
    r = run_main("patches", "verify", "0.1.0")
    assert r.code == 10
    assert "assert 5 == 6" in r.stderr
    assert r.stderr.splitlines()[-1].startswith(
        "ddeploy: error: ddtree/0.1.0: overlay tests failed in the patched tree (1 failed, 1 passed"
    )


def test_changed_context_line_in_the_base_is_a_conflict_and_the_base_is_untouched(
    small_overlay, patches_root, pristine_base, tmp_path
):
    export_patch_set(small_overlay, patches_root, date="2026-11-29")
    drifted = tmp_path / "drifted"
    subprocess.run(
        ["git", "clone", "-q", "--shared", "--no-checkout", str(pristine_base.path), str(drifted)], check=True
    )
    git(drifted, "read-tree", "HEAD")  # index only: no need to write 5771 files for one edit
    text = git_out(drifted, "show", f"HEAD:{SPEC}") + "\n"
    (drifted / SPEC).parent.mkdir(parents=True)
    (drifted / SPEC).write_text(
        text.replace(
            "Alias of --speculative-num-draft-tokens for DFLASH.", "Alias of --speculative-num-draft-tokens (DFLASH)."
        )
    )
    git(drifted, "add", SPEC)
    git(drifted, "commit", "-q", "-m", "drift one context line", env=FIXED_IDENTITY)
    head = git_out(drifted, "rev-parse", "HEAD")

    r = run_main("patches", "verify", "--against", str(drifted))
    assert r.code == 7
    lines = r.stderr.splitlines()
    assert "0001-ddtree-builder.patch: clean" in lines
    assert f"0003-ddtree-wiring.patch: conflict ({SPEC})" in lines
    assert lines[-1] == (
        f"ddeploy: error: patch 0003-ddtree-wiring.patch of ddtree/0.1.0 does not apply "
        f"strictly ({SPEC}); nothing was changed; refresh the overlay against the base and "
        f"export a new version"
    )
    assert git_out(drifted, "rev-parse", "HEAD") == head
    assert git_out(drifted, "status", "--porcelain", "--untracked-files=no", "--", SPEC) == ""
    assert git_out(pristine_base.path, "status", "--porcelain") == ""


def test_conflict_stops_the_series(small_overlay, tmp_path, pristine_base):
    concerns = {
        "name": "ddtree",
        "concerns": [
            {"id": "wiring", "title": "wiring", "description": "w", "hunks": ["hunks/wiring.patch"]},
            {"id": "builder", "title": "b", "description": "b", "files": ["python/**", "test/**"]},
        ],
    }
    overlay = make_overlay(tmp_path / "o2", concerns=concerns)
    ps = load_patch_set(export_patch_set(overlay, tmp_path / "sets", date="2026-11-29").path)
    drifted = tmp_path / "drifted"
    subprocess.run(
        ["git", "clone", "-q", "--shared", "--no-checkout", str(pristine_base.path), str(drifted)], check=True
    )
    git(drifted, "read-tree", "HEAD")
    git(drifted, "rm", "-q", "--cached", SPEC)
    git(drifted, "commit", "-q", "-m", "drop spec.py", env=FIXED_IDENTITY)
    report = verify_patch_set(ps, against=drifted, run_tests=False)
    assert [r.line() for r in report.results] == [
        f"0001-ddtree-wiring.patch: conflict ({SPEC})",
        "0002-ddtree-builder.patch: not reached",
    ]
    assert not report.ok and report.reversed_ok is None


class _PytestWithoutEngineTests:
    """`subprocess` for verify.py, whose pytest runs leave out the engine tests."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def run(cmd, *args, **kwargs):
        if "pytest" in cmd:
            cmd = [*cmd, "-k", "not engine"]
        return subprocess.run(cmd, *args, **kwargs)  # noqa: S603


@pytest.mark.slow
def test_real_overlay_exports_verifies_and_its_tests_pass_in_the_patched_tree(tmp_path, monkeypatch):
    overlay = overlay_dir()
    if not (overlay / "concerns.yaml").is_file():
        pytest.skip("no overlays/ddtree/concerns.yaml yet")
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(tmp_path / "patches"))
    # The overlay's real-server tests (about 20 minutes) run once, at the top level of this
    # suite; verify strips PYTEST_ADDOPTS, so its pytest command gets the -k here.
    monkeypatch.setattr(verify_module, "subprocess", _PytestWithoutEngineTests())
    export_patch_set(overlay, tmp_path / "patches" / "ddtree", date="2026-11-29")
    r = run_main("patches", "verify")
    assert "reversed to the base tree exactly" in r.stderr, r.stderr
    assert r.code == 0, r.stderr[-3000:]
