"""The pristine SGLang base: built from a cached wheel offline, verified by its tree hash."""

from __future__ import annotations

import subprocess

import pytest

from deployer.patchset.sglang_base import BASE_TREE_HASHES, SGLANG_VERSION, find_wheel
from deployer.patchset.local_git import FIXED_IDENTITY, git, git_out
from patchset_fixtures import pristine_base, run_main  # noqa: F401

VERSION_FILE = "python/sglang/version.py"


@pytest.fixture(scope="module")
def wheel():
    found = find_wheel()
    if found is None:
        pytest.skip("no cached SGLang wheel; run `ddeploy base fetch` once")
    return found


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(cache))
    monkeypatch.delenv("DDEPLOY_SGLANG_WHEEL", raising=False)
    return cache


def test_missing_wheel_is_a_clear_error(empty_cache, monkeypatch):
    monkeypatch.setenv("DDEPLOY_SGLANG_WHEEL", str(empty_cache / "nowhere.whl"))
    r = run_main("base", "fetch")
    assert r.code == 11  # ExitCode.BASE_TREE
    assert r.stderr == f"ddeploy: error: DDEPLOY_SGLANG_WHEEL={empty_cache / 'nowhere.whl'} is not a file\n"
    assert not (empty_cache / "base" / f"sglang-{SGLANG_VERSION}").exists()


def test_no_wheel_and_no_index_is_a_clear_error(empty_cache, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    r = run_main("base", "fetch")
    assert r.code == 11  # ExitCode.BASE_TREE
    assert f"cannot get the SGLang {SGLANG_VERSION} wheel" in r.stderr
    assert f"put sglang-{SGLANG_VERSION}-*.whl in {empty_cache / 'wheels'} or set DDEPLOY_SGLANG_WHEEL" in r.stderr


@pytest.fixture
def copied_base(empty_cache, pristine_base):
    repo = empty_cache / "base" / f"sglang-{SGLANG_VERSION}"
    subprocess.run(["git", "clone", "-q", str(pristine_base.path), str(repo)], check=True)
    return repo


@pytest.mark.slow  # several seconds: a full verify / base rebuild
def test_corruption_is_detected_and_rebuild_works_offline_from_the_cached_wheel(
    copied_base, empty_cache, wheel, monkeypatch
):
    assert run_main("base", "fetch").code == 0  # a good base is only verified, not rebuilt
    target = copied_base / VERSION_FILE
    target.write_text(target.read_text() + "# edited\n")
    r = run_main("base", "fetch")
    assert r.code == 11 and f"has local changes (M {VERSION_FILE})" in r.stderr
    git(copied_base, "commit", "-q", "-am", "a different base", env=FIXED_IDENTITY)
    r = run_main("base", "fetch")
    assert r.code == 11  # ExitCode.BASE_TREE
    assert f"expected {BASE_TREE_HASHES[SGLANG_VERSION]} for SGLang {SGLANG_VERSION}" in r.stderr
    assert "rebuild it with `ddeploy base fetch --rebuild`" in r.stderr

    (empty_cache / "wheels").mkdir()
    (empty_cache / "wheels" / wheel.name).symlink_to(wheel)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # any download attempt would fail: this is offline
    r = run_main("base", "fetch", "--rebuild")
    assert r.code == 0, r.stderr
    assert f"tree {BASE_TREE_HASHES[SGLANG_VERSION]}) verified" in r.stderr
    assert git_out(copied_base, "rev-parse", "HEAD^{tree}") == BASE_TREE_HASHES[SGLANG_VERSION]
    assert "# edited" not in (copied_base / VERSION_FILE).read_text()
    assert (copied_base / "python/sglang/srt/speculative/dflash_utils.py").is_file()
