"""Export: overlay -> released, deterministic, immutable patch set (real git, real SGLang base)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from deployer.errors import PatchSetError
from deployer.patchset.export import export_patch_set, sync_differences
from deployer.patchset.local_git import git, git_out
from deployer.patchset.release import load_patch_set
from patchset_fixtures import SMALL_CONCERNS, make_overlay, patches_root, pristine_base, run_main, small_overlay  # noqa: F401


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_twice_gives_identical_bytes_even_with_hostile_git_config(small_overlay, tmp_path, monkeypatch):
    a = export_patch_set(small_overlay, tmp_path / "a", version="0.1.0", date="2026-11-29")
    # A user config that would change format-patch output must not leak into the export.
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        "[diff]\n\tnoprefix = true\n\tmnemonicPrefix = true\n"
        "[format]\n\tsignature = hacked\n\tnumbered = true\n[core]\n\tabbrev = 7\n"
    )
    monkeypatch.setenv("HOME", str(home))
    # Byte-code and pytest caches left by running the overlay tests in place are never exported.
    (small_overlay / "python/ddtree_probe/__pycache__").mkdir()
    (small_overlay / "python/ddtree_probe/__pycache__/__init__.cpython-311.pyc").write_bytes(b"\x00junk")
    (small_overlay / ".pytest_cache").mkdir()
    (small_overlay / ".pytest_cache/README.md").write_text("cache\n")
    b = export_patch_set(small_overlay, tmp_path / "b", version="0.1.0", date="2026-11-29")
    assert tree_bytes(a.path) == tree_bytes(b.path)
    assert sorted(tree_bytes(a.path)) == [
        "0001-ddtree-builder.patch",
        "0003-ddtree-wiring.patch",
        "manifest.yaml",
        "series",
    ]


def test_exported_set_has_headers_series_and_manifest(small_overlay, tmp_path, pristine_base):
    result = export_patch_set(small_overlay, tmp_path / "sets", date="2026-11-29")
    assert result.version == "0.1.0" and result.skipped == ("retrieve",)
    d = result.path
    assert (d / "series").read_text() == "0001-ddtree-builder.patch\n0003-ddtree-wiring.patch\n"
    builder = (d / "0001-ddtree-builder.patch").read_text()
    assert builder.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] DDTree: probe builder\n\nA probe module and its test.\n" in builder
    assert "Date: Thu, 1 Jan 2026 00:00:00 +0000" in builder and "\n-- \n" not in builder
    manifest = yaml.safe_load((d / "manifest.yaml").read_text())
    assert manifest["base"] == {"sglang": "0.5.23", "tree": pristine_base.tree}
    assert manifest["created"] == "2026-11-29"
    assert manifest["skipped"] == [{"concern": "retrieve", "reason": "no files or hunks in the overlay"}]
    assert [p["files"] for p in manifest["patches"]] == [
        ["python/ddtree_probe/__init__.py", "test/srt/ddtree/test_probe.py"],
        [
            "python/sglang/srt/arg_groups/fields/spec.py",
            "python/sglang/srt/arg_groups/speculative_hook.py",
            "python/sglang/srt/managers/scheduler_components/batch_result_processor.py",
            "python/sglang/srt/managers/scheduler_components/internal_state.py",
            "python/sglang/srt/managers/scheduler_components/metrics_reporter.py",
            "python/sglang/srt/managers/tokenizer_manager.py",
            "python/sglang/srt/model_executor/runner/decode_cuda_graph_runner.py",
            "python/sglang/srt/speculative/dflash_utils.py",
            "python/sglang/srt/speculative/dflash_worker_v2.py",
            "python/sglang/srt/speculative/spec_info.py",
        ],
    ]
    ps = load_patch_set(d)
    assert [p.concern for p in ps.patches] == ["builder", "wiring"]


def test_created_date_comes_from_source_date_epoch(small_overlay, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")  # 2026-01-01T00:00:00Z
    result = export_patch_set(small_overlay, tmp_path / "sets")
    assert load_patch_set(result.path).created == "2026-01-01"


def test_export_over_a_released_version_is_refused_and_next_version_is_default(small_overlay, patches_root):
    first = run_main("patches", "export", "--overlay", str(small_overlay), "--date", "2026-11-29")
    assert first.code == 0, first.stderr
    assert "released 0.1.0" in first.stderr
    before = tree_bytes(patches_root / "0.1.0")
    again = run_main("patches", "export", "--overlay", str(small_overlay), "--version", "0.1.0")
    assert again.code == 4
    assert "patch set 0.1.0 is already released" in again.stderr and "next: 0.1.1" in again.stderr
    assert tree_bytes(patches_root / "0.1.0") == before
    second = run_main("patches", "export", "--overlay", str(small_overlay), "--date", "2026-11-30")
    assert second.code == 0 and "released 0.1.1" in second.stderr
    assert sorted(p.name for p in patches_root.iterdir()) == ["0.1.0", "0.1.1"]


@pytest.mark.slow  # several seconds: a full verify / base rebuild
def test_released_set_applies_strictly_then_reverses_to_the_base_tree(small_overlay, tmp_path, pristine_base):
    ps = load_patch_set(export_patch_set(small_overlay, tmp_path / "sets", date="2026-11-29").path)
    work = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(pristine_base.path), str(work)], check=True)
    for p in ps.patches:
        git(work, "apply", "--check", "-", input=p.data)
        git(work, "apply", "-", input=p.data)
    assert (work / "python/ddtree_probe/__init__.py").is_file()
    assert "speculative_dflash_tree_budget" in (work / "python/sglang/srt/arg_groups/fields/spec.py").read_text()
    for p in reversed(ps.patches):
        git(work, "apply", "-R", "--check", "-", input=p.data)  # confirms it is applied
        git(work, "apply", "-R", "-", input=p.data)
    git(work, "add", "-A")
    assert git_out(work, "write-tree") == pristine_base.tree


@pytest.mark.parametrize(
    "extra, words",
    [
        ("python/stray.py", "overlay file python/stray.py matches no concern"),
        ("python/ddtree_retrieve/x/both.py", None),
    ],
)
def test_overlay_file_in_no_concern_or_two_is_an_export_error(tmp_path, extra, words):
    concerns = yaml.safe_load(yaml.safe_dump(SMALL_CONCERNS))
    concerns["concerns"][0]["files"].append("python/**/both.py")
    overlay = make_overlay(tmp_path / "overlay", concerns=concerns)
    (overlay / extra).parent.mkdir(parents=True, exist_ok=True)
    (overlay / extra).write_text("x = 1\n")
    root = tmp_path / "sets"
    with pytest.raises(PatchSetError) as exc:
        export_patch_set(overlay, root, date="2026-11-29")
    expected = words or f"overlay file {extra} matches concerns builder and retrieve"
    assert expected in str(exc.value)
    assert not root.exists() or list(root.iterdir()) == []  # nothing left behind


def test_a_hunk_that_does_not_apply_fails_the_export_and_leaves_nothing(small_overlay, tmp_path):
    hunk = small_overlay / "hunks" / "wiring.patch"
    hunk.write_text(hunk.read_text().replace("Alias of --speculative-num-draft-tokens", "Alias of --nothing"))
    root = tmp_path / "sets"
    with pytest.raises(PatchSetError, match="hunk file hunks/wiring.patch \\(concern wiring\\) does not apply"):
        export_patch_set(small_overlay, root, date="2026-11-29")
    assert list(root.iterdir()) == []


def test_an_unsafe_hunk_is_refused_before_git_sees_it(small_overlay, tmp_path):
    (small_overlay / "hunks" / "wiring.patch").write_bytes(
        b"diff --git a/../x b/../x\nnew file mode 100644\n--- /dev/null\n+++ b/../x\n@@ -0,0 +1 @@\n+x\n"
    )
    with pytest.raises(PatchSetError, match="hunk.*escapes|escapes"):
        export_patch_set(small_overlay, tmp_path / "sets", date="2026-11-29")


def test_a_new_file_that_shadows_an_sglang_file_is_refused(small_overlay, tmp_path):
    concerns = yaml.safe_load((small_overlay / "concerns.yaml").read_text())
    concerns["concerns"][0]["files"].append("python/sglang/version.py")
    (small_overlay / "concerns.yaml").write_text(yaml.safe_dump(concerns))
    (small_overlay / "python/sglang").mkdir()
    (small_overlay / "python/sglang/version.py").write_text("__version__ = 'mine'\n")
    with pytest.raises(PatchSetError, match="python/sglang/version.py already exists in SGLang; change it with a hunk"):
        export_patch_set(small_overlay, tmp_path / "sets", date="2026-11-29")


def test_sync_check_names_the_patch_and_file_that_drifted(small_overlay, tmp_path):
    released = export_patch_set(small_overlay, tmp_path / "sets", date="2026-11-29").path
    assert sync_differences(small_overlay, released) == []
    (small_overlay / "test/srt/ddtree/test_probe.py").write_text("def test_x():\n    pass\n")
    assert sync_differences(small_overlay, released) == [
        "0001-ddtree-builder.patch: differs (~test/srt/ddtree/test_probe.py)"
    ]


def test_bad_date_is_a_usage_error(small_overlay, patches_root):
    r = run_main("patches", "export", "--overlay", str(small_overlay), "--date", "29/11/2026")
    assert r.code == 2 and "--date '29/11/2026' is not a date (YYYY-MM-DD)" in r.stderr
    assert not patches_root.exists()


def test_symlink_in_overlay_and_unlisted_hunk_are_export_errors(small_overlay, tmp_path):
    link = small_overlay / "python/ddtree_probe/link.py"
    link.symlink_to("/etc/passwd")
    with pytest.raises(PatchSetError, match="overlay file python/ddtree_probe/link.py is a symlink"):
        export_patch_set(small_overlay, tmp_path / "sets", date="2026-11-29")
    link.unlink()
    (small_overlay / "hunks" / "builder.patch").write_text("")
    with pytest.raises(PatchSetError, match="hunk file hunks/builder.patch is listed by no concern"):
        export_patch_set(small_overlay, tmp_path / "sets", date="2026-11-29")
