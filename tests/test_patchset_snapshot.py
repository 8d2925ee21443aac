"""Dev snapshots: the overlay's working copy exported like a release, versioned `<newest>+dev.<hash>`,
cached by content, never written under patches/ (real git, real SGLang base)."""

from __future__ import annotations

import re

import pytest

from deployer.errors import ChecksumError
from deployer.patchset.export import export_patch_set
from deployer.patchset.snapshot import dev_snapshot, snapshots_root
from patchset_fixtures import make_overlay, patches_root, pristine_base, run_main, small_overlay  # noqa: F401

PROBE = "python/ddtree_probe/__init__.py"


def test_a_snapshot_is_the_release_export_under_a_dev_version_and_lives_in_the_cache(small_overlay, patches_root):
    release = export_patch_set(small_overlay, patches_root, version="0.2.2", date="2026-11-29")
    snap = dev_snapshot(small_overlay)
    assert re.fullmatch(r"0\.2\.2\+dev\.[0-9a-f]{12}", snap.version) and snap.dev
    assert [(p.name, p.data) for p in snap.patches] == [(p.name, p.data) for p in release.patches]
    assert snap.path == snapshots_root("ddtree") / snap.version
    assert sorted(d.name for d in patches_root.iterdir()) == ["0.2.2"]  # nothing new under patches/


def test_an_unchanged_overlay_reuses_the_cached_snapshot_and_an_edit_makes_a_new_one(small_overlay, patches_root):
    first = dev_snapshot(small_overlay)
    assert first.version.startswith("0.0.0+dev.")  # no release yet: the base stands in
    (small_overlay / "python/ddtree_probe/__pycache__").mkdir()
    (small_overlay / "python/ddtree_probe/__pycache__/x.pyc").write_bytes(b"\0")  # never exported
    assert dev_snapshot(small_overlay).version == first.version
    (small_overlay / PROBE).write_text((small_overlay / PROBE).read_text() + "\nEDITED = True\n")
    second = dev_snapshot(small_overlay)
    assert second.version != first.version and b"+EDITED = True" in second.patches[0].data
    assert first.path.is_dir() and second.path.is_dir() and first.path.parent == second.path.parent


def test_a_tampered_cached_snapshot_is_refused_like_a_release(small_overlay, patches_root):
    snap = dev_snapshot(small_overlay)
    patch = snap.path / snap.patches[0].name
    patch.write_bytes(patch.read_bytes() + b"\n")
    with pytest.raises(ChecksumError, match=f"patch {snap.patches[0].name} in .* was modified"):
        dev_snapshot(small_overlay)


def test_overlay_and_version_together_are_a_usage_error(small_overlay, patches_root):
    r = run_main("plan", "--host", "local", "--overlay", str(small_overlay), "--version", "0.1.0")
    assert r.code == 2 and "--overlay uses a dev snapshot of the overlay; drop --version" in r.stderr
    r = run_main("push", "--host", "local", "--diff")
    assert r.code == 2 and "--diff shows what push would change; add --dry-run" in r.stderr


def test_a_directory_without_concerns_is_not_an_overlay(tmp_path, patches_root):
    r = run_main("plan", "--host", "local", "--overlay", str(tmp_path))
    assert r.code != 0 and f"{tmp_path} is not an overlay (no concerns.yaml); pass --overlay DIR" in r.stderr
