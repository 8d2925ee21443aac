"""The release window: the tree holds the newest releases and the pinned ones; every older one is
recorded in patches/ddtree/archive.yaml and `ddeploy patches restore V` brings it back from its
tag, else from the recorded commit, verified. The clones are made from the repository these tests
run in (objects hard-linked, only patches/ checked out), so they need no network."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deployer.locations import patch_set_root
from deployer.patchset.archive import apply_window, read_archive, restore_release, shipped_pins, window
from deployer.patchset.release import list_versions, load_patch_set, sha256_bytes
from patchset_fixtures import run_main

REPO = Path(__file__).resolve().parents[1]
ROOT = patch_set_root()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _history() -> None:
    """Skip where the tests do not run in a git checkout with the releases' history."""
    probe = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True)
    if probe.returncode != 0 or probe.stdout.strip() != b"false":
        pytest.skip(f"{REPO} is not a full git clone (run `git fetch --unshallow --tags` there)")


def _clone(dest: Path, *extra: str) -> Path:
    """A clone of this repository's HEAD with only patches/ checked out; its sets root."""
    source = f"file://{REPO}" if "--depth" in extra else str(REPO)
    subprocess.run(["git", "clone", "-q", "--no-checkout", *extra, source, str(dest)], check=True)
    _git(dest, "checkout", "-q", "HEAD", "--", "patches")
    return dest / "patches" / "ddtree"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def oldest() -> str:
    archived = sorted(read_archive(ROOT), key=lambda v: tuple(map(int, v.split("."))))
    assert archived, f"{ROOT}/archive.yaml records no archived release"
    return archived[0]


# --- the rule ------------------------------------------------------------------------------------


def test_the_window_is_the_newest_three_plus_the_pinned_ones():
    versions = ["0.1.0", "0.1.1", "0.2.0", "0.2.10", "0.2.9", "0.2.11"]
    assert window(versions) == ["0.2.9", "0.2.10", "0.2.11"]
    assert window(versions, pins=["0.1.1", "9.9.9"]) == ["0.1.1", "0.2.9", "0.2.10", "0.2.11"]


def test_the_tree_holds_exactly_the_release_window():
    in_tree, archived = list_versions(root=ROOT), read_archive(ROOT)
    assert not set(in_tree) & set(archived), "a release is both in the tree and in archive.yaml"
    expected = window([*in_tree, *archived], shipped_pins())
    assert in_tree == expected, (
        f"patches/ddtree holds {in_tree}, the release window says {expected}; run `ddeploy patches archive`"
    )


def test_every_archived_release_names_the_commit_that_added_it_and_its_manifest():
    _history()
    for version, record in read_archive(ROOT).items():
        path = f"patches/ddtree/{version}/manifest.yaml"
        added = _git(REPO, "log", "--diff-filter=A", "--format=%H", "--", path).split()  # newest first
        assert record.commit in added and record.tag == f"ddtree-{version}"
        manifest = subprocess.run(["git", "-C", str(REPO), "show", f"{record.commit}:{path}"], capture_output=True)
        assert sha256_bytes(manifest.stdout) == record.manifest_sha256
        for earlier in added[added.index(record.commit) + 1 :]:  # an export withdrawn before release
            withdrawn = subprocess.run(["git", "-C", str(REPO), "show", f"{earlier}:{path}"], capture_output=True)
            assert sha256_bytes(withdrawn.stdout) != record.manifest_sha256, (version, earlier)


def test_a_host_file_pins_a_release_version_only():
    from deployer.errors import InventoryError
    from deployer.inventory import parse_host

    doc = {"name": "p", "connection": "local", "gpu": {"model": "x", "count": 1, "arch": "sm_120"}}
    doc |= {"interconnect": "pcie", "checkout": "/opt/sglang"}
    assert parse_host({**doc, "version": "0.2.9"}, "p.yaml").version == "0.2.9"
    with pytest.raises(InventoryError, match=r"p.yaml: host 'p': field version: 0.3 must be a released version"):
        parse_host({**doc, "version": 0.3}, "p.yaml")


def test_push_and_plan_give_each_host_its_pin_and_the_others_the_latest():
    from types import SimpleNamespace

    from deployer.cli.deploy import _reply_set, _sets_for
    from deployer.inventory import parse_host

    doc = {"connection": "local", "gpu": {"model": "x", "count": 1, "arch": "sm_120"}}
    doc |= {"interconnect": "pcie", "checkout": "/opt/sglang"}
    newest = list_versions(root=ROOT)[-1]
    hosts = [parse_host({**doc, "name": "p1", "version": list_versions(root=ROOT)[0]}, "p1.yaml")]
    hosts.append(parse_host({**doc, "name": "p2"}, "p2.yaml"))
    sets = _sets_for(hosts, None, None)
    assert (sets["p1"].version, sets["p2"].version) == (hosts[0].version, newest)
    reply = SimpleNamespace(plan=SimpleNamespace(version=hosts[0].version))
    assert _reply_set(sets)(reply) is sets["p1"] and _reply_set(sets)(SimpleNamespace(push=reply)) is sets["p1"]
    assert {ps.version for ps in _sets_for(hosts, "latest", None).values()} == {newest}


# --- restore -------------------------------------------------------------------------------------


def test_restore_brings_an_archived_release_back_by_tag_then_by_recorded_commit(tmp_path, cache, oldest):
    _history()
    root = _clone(tmp_path / "clone")
    record = read_archive(root)[oldest]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "-q", "--verify", f"refs/tags/{record.tag}"]).returncode:
        _git(root, "tag", record.tag, record.commit)  # a CI clone may carry no tags
    by_tag = restore_release(oldest, root=root)
    assert by_tag.source == f"tag {record.tag}" and not (root / oldest).exists()  # the tree stays the window
    ps = load_patch_set(by_tag.path)
    assert ps.version == oldest and sha256_bytes((by_tag.path / "manifest.yaml").read_bytes()) == record.manifest_sha256
    for p in ps.patches:
        committed = subprocess.run(
            ["git", "-C", str(root), "show", f"{record.commit}:patches/ddtree/{oldest}/{p.name}"], capture_output=True
        ).stdout
        assert p.data == committed
    shutil.rmtree(cache)
    _git(root, "tag", "-d", record.tag)
    by_commit = restore_release(oldest, root=root)
    assert by_commit.source.startswith(f"commit {record.commit[:12]} (archive.yaml; no tag {record.tag} here)")
    assert load_patch_set(by_commit.path).fingerprint() == ps.fingerprint()


def test_the_cli_refuses_an_archived_release_until_it_is_restored(tmp_path, cache, oldest, monkeypatch):
    _history()
    root = _clone(tmp_path / "clone", "--no-tags")
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(root.parent))
    r = run_main("patches", "show", oldest)
    assert r.code == 4 and r.stderr.strip().endswith(
        f"is archived (outside the release window, git tag ddtree-{oldest}); "
        f"bring it back with `ddeploy patches restore {oldest}`"
    )
    listed = run_main("patches", "list").stderr.splitlines()
    assert [row.split()[2:4] for row in listed if row.startswith(f"{oldest} ")] == [["archived", f"ddtree-{oldest}"]]
    r = run_main("patches", "restore", oldest)
    assert r.code == 0, r.stderr
    assert f"restored ddtree {oldest} (" in r.stderr and "checksums verified) from commit " in r.stderr
    assert run_main("patches", "show", oldest).code == 0
    assert f"is already at {cache / 'releases' / 'ddtree' / oldest}" in run_main("patches", "restore", oldest).stderr


def test_restore_errors_say_what_to_do(tmp_path, cache, oldest, monkeypatch):
    _history()
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(ROOT.parent))
    r = run_main("patches", "restore", "9.9.9")
    assert r.code == 4 and f"unknown ddtree release 9.9.9 under {ROOT} (released: " in r.stderr
    installed = tmp_path / "share" / "patches" / "ddtree"  # as `pip install .` ships it: no history
    shutil.copytree(ROOT, installed)
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(installed.parent))
    r = run_main("patches", "restore", oldest)
    assert r.code == 4 and f"{installed} is not in a git checkout" in r.stderr
    assert "set DDEPLOY_PATCHES_DIR to such a clone's patches/" in r.stderr
    shallow = _clone(tmp_path / "shallow", "--depth", "1", "--no-tags")
    monkeypatch.setenv("DDEPLOY_PATCHES_DIR", str(shallow.parent))
    r = run_main("patches", "restore", oldest)
    assert r.code == 4 and r.stderr.strip().endswith(
        "(a shallow clone); run `git fetch --unshallow --tags`, then restore again"
    )


def test_a_host_pinned_to_an_archived_release_is_refused_naming_the_restore_command(tmp_path, cache, oldest):
    inventory = tmp_path / "inv"
    inventory.mkdir()
    host = {"name": "p1", "connection": "local", "gpu": {"model": "x", "count": 1, "arch": "sm_120"}}
    host |= {"interconnect": "pcie", "checkout": str(tmp_path / "none"), "version": oldest}
    (inventory / "p1.yaml").write_text(yaml.safe_dump(host))
    r = run_main("-i", str(inventory), "plan", "--host", "p1")
    assert r.code == 4
    assert f"[p1] {inventory / 'p1.yaml'} pins {oldest}: patch set ddtree {oldest} is archived" in r.stderr
    assert r.stderr.strip().endswith(f"bring it back with `ddeploy patches restore {oldest}`")


# --- applying the window -------------------------------------------------------------------------


def _release_repo(repo: Path, versions: list[str]) -> Path:
    """A git repository with small copies of the newest release as `versions`, one commit each."""
    _git(repo.parent, "init", "-q", repo.name)
    for v in versions:
        _release(repo, v)
    return repo / "patches" / "ddtree"


def _release(repo: Path, version: str, created: str | None = None) -> str:
    """Commit a copy of the newest release as `version` (its manifest's date `created`); the commit."""
    source = ROOT / list_versions(root=ROOT)[-1]
    dest = repo / "patches" / "ddtree" / version
    shutil.copytree(source, dest)
    manifest = (dest / "manifest.yaml").read_text().replace(f"version: {source.name}\n", f"version: {version}\n")
    if created:
        manifest = re.sub(r"^created: .*$", f"created: '{created}'", manifest, count=1, flags=re.M)
    (dest / "manifest.yaml").write_text(manifest)
    return _commit(repo, f"Release {version}")


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def test_archive_tags_records_and_removes_what_falls_out_and_returns_a_pinned_one(tmp_path, cache):
    root = _release_repo(tmp_path / "repo", ["1.0.0", "1.0.1", "1.0.2", "1.0.3", "1.0.4"])
    change = apply_window(root, pins=["1.0.0"], keep=2)
    assert (change.archived, change.returned) == (["1.0.1", "1.0.2"], [])
    assert list_versions(root=root) == ["1.0.0", "1.0.3", "1.0.4"]
    assert _git(root, "tag", "--list").split() == [f"ddtree-1.0.{i}" for i in range(5)]
    record = read_archive(root)["1.0.1"]
    assert record.commit == _git(root, "rev-parse", "ddtree-1.0.1^{commit}")
    assert restore_release("1.0.1", root=root).source == "tag ddtree-1.0.1"
    _git(root, "add", "-A", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "window")
    change = apply_window(root, pins=["1.0.0", "1.0.2"], keep=2)
    assert (change.archived, change.returned) == ([], ["1.0.2"])
    assert list_versions(root=root) == ["1.0.0", "1.0.2", "1.0.3", "1.0.4"] and list(read_archive(root)) == ["1.0.1"]


def test_a_release_exported_withdrawn_and_exported_again_is_archived_from_its_second_export(tmp_path, cache):
    """The withdrawn export's commit holds other files: the record, the tag and a restore take the
    commit that added the released ones."""
    repo = tmp_path / "repo"
    root = _release_repo(repo, [])
    withdrawn = _release(repo, "1.0.0", created="2026-01-01")
    shutil.rmtree(root / "1.0.0")
    _commit(repo, "withdraw 1.0.0")
    released = _release(repo, "1.0.0", created="2026-01-02")
    _release(repo, "1.0.1")
    _release(repo, "1.0.2")
    change = apply_window(root, pins=[], keep=2)
    assert change.archived == ["1.0.0"]
    record = read_archive(root)["1.0.0"]
    assert record.commit == released != withdrawn and record.created == "2026-01-02"
    assert _git(repo, "rev-parse", "ddtree-1.0.0^{commit}") == released
    restored = restore_release("1.0.0", root=root)
    assert restored.source == "tag ddtree-1.0.0"
    assert load_patch_set(restored.path).created == "2026-01-02"
