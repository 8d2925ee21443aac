"""Real SGLang checkouts (upstream-style clones, the user's own commits, shallow clones) and the
cases where a push or rollback could lose the user's work; on real sshd hosts, every outcome read
back with plain git (bytes on disk, index, refs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deployer.patchset import load_patch_set
from sshd_hosts import VERSION_PY

pytestmark = pytest.mark.sshd

SPEC_PY = "python/sglang/srt/arg_groups/fields/spec.py"  # a file the real release's wiring edits


def git(repo: Path, *args: str, input: bytes | None = None) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "user",
        "GIT_AUTHOR_EMAIL": "user@example.com",
        "GIT_COMMITTER_NAME": "user",
        "GIT_COMMITTER_EMAIL": "user@example.com",
    }
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, input=input, env=env)
    return out.stdout.decode().strip()


def show(repo: Path, spec: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "show", spec], check=True, capture_output=True).stdout


def empty_dirs(root: Path) -> list[str]:
    return sorted(
        str(Path(d).relative_to(root))
        for d, subdirs, files in os.walk(root)
        if ".git" not in Path(d).relative_to(root).parts and not subdirs and not files and Path(d) != root
    )


def upstream_like(checkout: Path, base_commit: str, work: Path, *, user_edit: tuple[str, str] | None = None) -> str:
    """Replace `checkout` by an upstream-style clone: an unrelated root commit, the base's files
    added in a later commit (tagged v0.5.23), extra top-level directories, then the user's own
    commit (an unrelated file, or `user_edit` = (path, new first line) of a file). Returns HEAD."""
    work.mkdir()
    git(work, "init", "-q", "-b", "main")
    for rel, text in {
        "README.md": "# sglang\n",
        "sgl-kernel/CMakeLists.txt": "project(sgl_kernel)\n",
        "docs/index.md": "docs\n",
        "test/srt/test_existing.py": "def test_upstream():\n    pass\n",
    }.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "upstream: initial commit")
    archive = subprocess.run(["git", "-C", str(checkout), "archive", base_commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive.stdout, check=True)
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "v0.5.23")
    git(work, "tag", "v0.5.23")
    if user_edit:
        rel, first = user_edit
        lines = (work / rel).read_text().splitlines(keepends=True)
        (work / rel).write_text(first + "\n" + "".join(lines[1:]))
    else:
        (work / "docs" / "team.md").write_text("our own notes\n")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "team: our own commit")
    shutil.rmtree(checkout)
    work.rename(checkout)
    return git(checkout, "rev-parse", "HEAD")


@pytest.fixture
def swap_checkout(hosts, tmp_path):
    """Put a checkout of the test's making in place of a host's (the pristine clone comes back after)."""
    swapped: list[tuple[Path, Path]] = []

    def swap(h):
        keep = tmp_path / f"{h.name}-pristine"
        shutil.copytree(h.checkout, keep, symlinks=True)
        swapped.append((h.checkout, keep))
        return h.checkout

    yield swap
    for checkout, keep in swapped:
        shutil.rmtree(checkout, ignore_errors=True)
        keep.rename(checkout)


def release():
    ps = load_patch_set("latest")
    return ps, str(ps.path)


def test_upstream_clone_with_user_commit_push_noop_rollback(hosts, ddeploy, swap_checkout, tmp_path):
    h = hosts.hosts[0]
    ps, version = release()
    co = swap_checkout(h)
    user_head = upstream_like(co, hosts.base_commit, tmp_path / "up")
    user_tree = git(co, "rev-parse", "HEAD^{tree}")
    # What plain `git apply` of the series gives on this checkout:
    expect = tmp_path / "expect"
    subprocess.run(["git", "clone", "-q", "--shared", str(co), str(expect)], check=True)
    git(expect, "apply", "--index", *[str(ps.path / p.name) for p in ps.patches])
    expected_tree = git(expect, "write-tree")

    r = ddeploy("push", "--host", "h1", "--version", version)
    assert r.code == 0, r.stderr
    assert git(co, "rev-parse", "HEAD^{tree}") == expected_tree
    assert git(co, "rev-parse", f"HEAD~{len(ps.patches)}") == user_head  # built on the user's HEAD
    assert git(co, "status", "--porcelain", "--untracked-files=all") == ""
    assert (co / "sgl-kernel" / "CMakeLists.txt").read_text() == "project(sgl_kernel)\n"

    r = ddeploy("status", "--host", "h1", "--json")
    row = json.loads(r.stdout)[0]["data"]
    assert row["base"]["mismatched"] == [] and row["base"]["commit"] == user_head, row
    assert ", base ok" in r.stderr

    refs = git(co, "for-each-ref")
    r = ddeploy("push", "--host", "h1", "--version", version, "--json")
    assert r.code == 0 and json.loads(r.stdout)[0]["changed"] is False
    assert git(co, "for-each-ref") == refs

    r = ddeploy("rollback", "--host", "h1")
    assert r.code == 0, r.stderr
    assert git(co, "rev-parse", "HEAD") == user_head and git(co, "rev-parse", "HEAD^{tree}") == user_tree
    assert git(co, "symbolic-ref", "--short", "HEAD") == "main"
    assert git(co, "status", "--porcelain", "--untracked-files=all", "--ignored") == ""
    assert not (co / "test" / "srt" / "ddtree").exists() and (co / "test" / "srt" / "test_existing.py").exists()
    assert empty_dirs(co) == []
    assert git(co, "log", "--format=%s", "-3").splitlines() == [
        "team: our own commit",
        "v0.5.23",
        "upstream: initial commit",
    ]


def test_a_touched_file_that_differs_is_refused_by_name_and_merged_with_3way(
    hosts, ddeploy, swap_checkout, tmp_path, patch_sets
):
    h = hosts.hosts[1]
    co = swap_checkout(h)
    first = (co / VERSION_PY).read_text().splitlines()[0]
    user_head = upstream_like(co, hosts.base_commit, tmp_path / "up", user_edit=(VERSION_PY, first + "  # ours"))
    user_tree = git(co, "rev-parse", "HEAD^{tree}")
    refs = git(co, "for-each-ref")
    r = ddeploy("push", "--host", "h2", "--version", str(patch_sets["v1"]))
    assert r.code == 11, r.stderr  # BaseTreeError
    assert f"{VERSION_PY} is not the SGLang 0.5.23 version that ddtree 0.1.0 expects" in r.stderr
    assert "rerun with --3way" in r.stderr and "nothing was changed" in r.stderr
    assert git(co, "rev-parse", "HEAD") == user_head and git(co, "for-each-ref") == refs
    r = ddeploy("status", "--host", "h2", "--json")
    assert r.code == 0 and "not the base" not in r.stderr  # the newest release does not touch version.py

    r = ddeploy("push", "--host", "h2", "--version", str(patch_sets["v1"]), "--3way")
    assert r.code == 0, r.stderr
    text = (co / VERSION_PY).read_text()
    assert text.startswith(first + "  # ours\n") and text.endswith("# ddtree 0.1.0\n")
    assert git(co, "rev-parse", "HEAD~2") == user_head
    assert ddeploy("rollback", "--host", "h2").code == 0
    assert git(co, "rev-parse", "HEAD") == user_head and git(co, "rev-parse", "HEAD^{tree}") == user_tree


def test_status_names_the_checkout_and_whether_touched_files_are_the_base(hosts, ddeploy, swap_checkout, tmp_path):
    h = hosts.hosts[2]
    co = swap_checkout(h)
    upstream_like(co, hosts.base_commit, tmp_path / "up", user_edit=(SPEC_PY, "# our tweak"))
    r = ddeploy("status", "--host", "h3", "--json")
    assert r.code == 0, r.stderr
    base = json.loads(r.stdout)[0]["data"]["base"]
    assert [m["path"] for m in base["mismatched"]] == [SPEC_PY]
    assert "1 file(s) not the base" in r.stderr
    r = ddeploy("plan", "--host", "h3", "--version", release()[1])
    assert r.code == 11 and f"push would be refused: {SPEC_PY} is not the SGLang 0.5.23 version" in r.stderr


def test_shallow_clones_work_and_say_what_is_missing(hosts, ddeploy, swap_checkout, tmp_path):
    ps, version = release()
    h1, h2 = hosts.hosts[0], hosts.hosts[1]
    # A depth-1 clone of the base: every blob the series needs is there.
    co = swap_checkout(h1)
    source = tmp_path / "source"
    shutil.copytree(co, source, symlinks=True)
    shutil.rmtree(co)
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{source}", str(co)], check=True)
    assert git(co, "rev-parse", "--is-shallow-repository") == "true"
    r = ddeploy("push", "--host", "h1", "--version", version)
    assert r.code == 0, r.stderr
    assert ddeploy("rollback", "--host", "h1").code == 0
    # A depth-1 clone of a user commit that edits a touched file: --3way needs the base blob.
    co2 = swap_checkout(h2)
    upstream_like(co2, hosts.base_commit, tmp_path / "up", user_edit=(SPEC_PY, "# our tweak"))
    upstream = tmp_path / "upstream"
    co2.rename(upstream)
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{upstream}", str(co2)], check=True)
    r = ddeploy("push", "--host", "h2", "--version", version, "--3way")
    assert r.code == 11, r.stderr
    want = ps.preimages()[SPEC_PY]
    assert f"cannot 3-way merge {SPEC_PY}: the base blob {want[:12]} the patch was made against" in r.stderr
    assert "fetch more history" in r.stderr and git(co2, "for-each-ref", "refs/ddeploy") == ""


# ---------------------------------------------------------------- no byte of user work lost
def test_an_untracked_file_where_the_set_makes_a_directory_is_in_the_way(hosts, ddeploy):
    h = hosts.hosts[0]
    ps, version = release()
    assert any(f.startswith("test/") for f in ps.files) and not (h.checkout / "test").exists()
    (h.checkout / "test").write_bytes(b"my notes, not tracked\n")
    r = ddeploy("plan", "--host", "h1", "--version", version)
    assert r.code == 7, r.stderr
    assert "[h1] in the way: test" in r.stderr
    assert "push would be refused: in the way: test (untracked, where the set writes)" in r.stderr
    r = ddeploy("push", "--host", "h1", "--version", version)
    assert r.code == 7 and "in the way: test" in r.stderr and "--force" in r.stderr
    assert (h.checkout / "test").read_bytes() == b"my notes, not tracked\n"
    assert h.git("rev-parse", "HEAD") == hosts.base_commit
    r = ddeploy("push", "--host", "h1", "--version", version, "--force", "--json")
    assert r.code == 0, r.stderr
    ref = json.loads(r.stdout)[0]["data"]["saved"]
    assert h.git("show", f"{ref}:test") == "my notes, not tracked"
    assert (h.checkout / "test" / "srt" / "ddtree").is_dir()


def test_force_saves_the_staged_and_the_work_tree_version(hosts, ddeploy, patch_sets):
    h = hosts.hosts[1]
    path = h.checkout / VERSION_PY
    original = path.read_bytes()
    path.write_bytes(original + b"# staged\n")
    h.git("add", VERSION_PY)
    path.write_bytes(original + b"# staged\n# then edited again\n")
    r = ddeploy("push", "--host", "h2", "--version", str(patch_sets["v1"]), "--force", "--json")
    assert r.code == 0, r.stderr
    ref = json.loads(r.stdout)[0]["data"]["saved"]
    assert show(h.checkout, f"{ref}^2:{VERSION_PY}") == original + b"# staged\n"  # the index
    assert show(h.checkout, f"{ref}:{VERSION_PY}") == original + b"# staged\n# then edited again\n"  # work tree
    assert h.git("rev-parse", f"{ref}^1") == hosts.base_commit
    # The documented restore brings both back once the set is rolled back.
    assert ddeploy("rollback", "--host", "h2").code == 0
    h.git("stash", "apply", "--index", ref)
    assert path.read_bytes() == original + b"# staged\n# then edited again\n"
    assert show(h.checkout, f":{VERSION_PY}") == original + b"# staged\n"


def test_rollback_removes_the_directories_the_set_made_only_when_empty(hosts, ddeploy):
    h = hosts.hosts[2]
    ps, version = release()
    assert empty_dirs(h.checkout) == []
    before = {str(p.relative_to(h.checkout)) for p in h.checkout.rglob("*") if ".git" not in p.parts}
    assert ddeploy("push", "--host", "h3", "--version", version).code == 0
    made = sorted({str(Path(f).parent) for f in ps.files} - before)
    assert "test/srt/ddtree" in made
    assert ddeploy("rollback", "--host", "h3").code == 0
    assert empty_dirs(h.checkout) == [] and not (h.checkout / "test").exists()
    after = {str(p.relative_to(h.checkout)) for p in h.checkout.rglob("*") if ".git" not in p.parts}
    assert after == before
    # A directory the set made that holds a file of the user's stays (with the file).
    assert ddeploy("push", "--host", "h3", "--version", version).code == 0
    (h.checkout / "test" / "srt" / "ddtree" / "mine.txt").write_text("keep me\n")
    assert ddeploy("rollback", "--host", "h3").code == 0
    assert (h.checkout / "test" / "srt" / "ddtree" / "mine.txt").read_text() == "keep me\n"
    assert not (h.checkout / "test" / "srt" / "ddtree" / "conftest.py").exists()
