"""Path safety of patches and the verified loader: unsafe paths, symlinks, tampering."""

from __future__ import annotations

import subprocess

import pytest

from deployer.errors import ChecksumError, PatchSetError, PathSafetyError
from deployer.patchset.path_safety import check_path, patch_paths, split_diff_git, unquote_git_path
from deployer.patchset.release import load_patch_set, next_version
from patchset_fixtures import patches_root, pristine_base, run_main, write_raw_set  # noqa: F401


def new_file_patch(path: str, body: str = "x\n", mode: str = "100644") -> bytes:
    lines = body.splitlines(keepends=True)
    hunk = "".join("+" + ln for ln in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{hunk}"
    ).encode()


def test_plain_patch_lists_its_files_without_prefixes():
    data = new_file_patch("python/sglang/srt/speculative/ddtree_tree.py") + new_file_patch(
        "test/srt/ddtree/test_ddtree_tree.py"
    )
    assert patch_paths(data, patch="p") == [
        "python/sglang/srt/speculative/ddtree_tree.py",
        "test/srt/ddtree/test_ddtree_tree.py",
    ]


@pytest.mark.parametrize(
    "path, words",
    [
        ("../outside.py", "escapes the checkout"),
        ("python/../../etc/passwd", "escapes the checkout"),
        (".git/hooks/post-checkout", "inside .git/"),
        ("python/.GIT/config", "inside .git/"),
    ],
)
def test_unsafe_relative_paths_are_refused_naming_patch_and_path(path, words):
    with pytest.raises(PathSafetyError) as exc:
        patch_paths(new_file_patch(path), patch="0001-evil.patch")
    assert "0001-evil.patch" in str(exc.value) and words in str(exc.value)
    assert path.split("/")[-1] in str(exc.value)


def test_absolute_paths_are_refused_with_or_without_prefix():
    data = b"--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-root\n+r00t\n"
    with pytest.raises(PathSafetyError, match=r"patch p: absolute path '/etc/passwd'"):
        patch_paths(data, patch="p")
    data = b"diff --git a//etc/shadow b//etc/shadow\n"
    with pytest.raises(PathSafetyError, match="absolute path '/etc/shadow'"):
        patch_paths(data, patch="p")


@pytest.mark.parametrize("mode, kind", [("120000", "symlink"), ("160000", "submodule")])
def test_symlinks_and_submodules_are_refused(mode, kind):
    with pytest.raises(PathSafetyError, match=f"patch p: creates or changes a {kind} \\(mode {mode}\\)"):
        patch_paths(new_file_patch("python/link", "target", mode=mode), patch="p")
    change = b"diff --git a/x b/x\nold mode 100644\nnew mode 120000\n"
    if mode == "120000":
        with pytest.raises(PathSafetyError, match="symlink"):
            patch_paths(change, patch="p")


def test_symlink_patch_made_by_git_itself_is_refused(tmp_path):
    repo = tmp_path / "r"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "link").symlink_to("/etc/passwd")
    subprocess.run(["git", "-C", str(repo), "add", "link"], check=True)
    data = subprocess.run(["git", "-C", str(repo), "diff", "--cached"], capture_output=True, check=True).stdout
    assert b"new file mode 120000" in data
    with pytest.raises(PathSafetyError, match="symlink"):
        patch_paths(data, patch="0001-link.patch")


def test_removed_line_that_looks_like_a_header_is_hunk_content():
    # Removing "-- a/../x" and adding "++ b/../y" makes body lines "--- a/../x" / "+++ b/../y".
    data = (
        b"diff --git a/doc.txt b/doc.txt\n--- a/doc.txt\n+++ b/doc.txt\n@@ -1,3 +1,3 @@\n"
        b" keep\n--- a/../x\n+++ b/../y\n keep\n"
    )
    assert patch_paths(data, patch="p") == ["doc.txt"]


def test_header_after_a_short_hunk_is_still_checked():
    data = b"diff --git a/ok b/ok\n--- a/ok\n+++ b/ok\n@@ -1 +1 @@\n-a\n+b\ndiff --git a/../evil b/../evil\n"
    with pytest.raises(PathSafetyError, match=r"'\.\./evil' escapes"):
        patch_paths(data, patch="p")


def test_header_in_a_commit_message_is_checked_like_git_apply_would():
    data = b"Subject: [PATCH] x\n\nsneaky:\n--- a/../../etc/x\n+++ b/../../etc/x\n"
    with pytest.raises(PathSafetyError, match="escapes"):
        patch_paths(data, patch="p")


def test_quoted_paths_are_unquoted_then_checked():
    assert unquote_git_path('"a/sp ac\\303\\251.py"') == "a/sp acé.py"
    assert split_diff_git('"a/x y" "b/x y"') == ['"a/x y"', '"b/x y"']
    assert split_diff_git("a/x y b/x y") == ["a/x y", "b/x y"]
    assert split_diff_git('a/plain "b/q\\"uote"') == ["a/plain", '"b/q\\"uote"']
    assert split_diff_git("a/x.py b/../../.bashrc") == ["a/x.py", "b/../../.bashrc"]
    ok = b'diff --git "a/python/t\\303\\251st.py" "b/python/t\\303\\251st.py"\n'
    assert patch_paths(ok, patch="p") == ["python/tést.py"]
    evil = b'diff --git "a/\\056\\056/evil" "b/\\056\\056/evil"\n'  # octal-escaped ".."
    with pytest.raises(PathSafetyError, match="escapes"):
        patch_paths(evil, patch="p")


def test_rename_and_copy_targets_are_checked():
    data = b"diff --git a/a.py b/a.py\nsimilarity index 100%\nrename from a.py\nrename to ../a.py\n"
    with pytest.raises(PathSafetyError, match=r"'\.\./a\.py' escapes"):
        patch_paths(data, patch="p")
    data = b"diff --git a/a.py b/c.py\ncopy from a.py\ncopy to .git/config\n"
    with pytest.raises(PathSafetyError, match="inside .git/"):
        patch_paths(data, patch="p")
    ok = b"diff --git a/a.py b/b.py\nsimilarity index 100%\nrename from a.py\nrename to b.py\n"
    assert patch_paths(ok, patch="p") == ["a.py", "b.py"]


def test_binary_payload_is_skipped():
    data = (
        b"diff --git a/img.bin b/img.bin\nnew file mode 100644\nindex 0000000..1111111\n"
        b"GIT binary patch\nliteral 5\ndiff --git a/../x b/../x\n\nliteral 0\nHcmV?d00001\n\n"
    )
    assert patch_paths(data, patch="p") == ["img.bin"]


def test_check_path_refuses_malformed_paths():
    for bad in ("a/", "a/x\\..\\y", "a/x\x00y"):
        with pytest.raises(PathSafetyError):
            check_path(bad, patch="p", strip_prefix=True)
    assert check_path("a/python/.gitignore", patch="p", strip_prefix=True) == "python/.gitignore"


def test_loader_refuses_a_tampered_patch(tmp_path):
    d = write_raw_set(tmp_path / "0.1.0", {"0001-ddtree-builder.patch": new_file_patch("python/x.py")})
    assert load_patch_set(d).patches[0].files == ("python/x.py",)
    data = bytearray((d / "0001-ddtree-builder.patch").read_bytes())
    data[-2] ^= 0x01  # flip one bit of one byte
    (d / "0001-ddtree-builder.patch").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="patch 0001-ddtree-builder.patch .* was modified: sha256"):
        load_patch_set(d)


def test_loader_refuses_series_manifest_disagreement_and_missing_patch(tmp_path):
    d = write_raw_set(tmp_path / "0.1.0", {"0001-ddtree-builder.patch": new_file_patch("python/x.py")})
    (d / "series").write_text("0001-ddtree-builder.patch\n0002-ddtree-other.patch\n")
    with pytest.raises(PatchSetError, match="does not match manifest"):
        load_patch_set(d)
    (d / "series").write_text("0001-ddtree-builder.patch\n")
    (d / "0001-ddtree-builder.patch").unlink()
    with pytest.raises(PatchSetError, match="listed in series is missing"):
        load_patch_set(d)


def test_next_version_bumps_the_newest_patch_version():
    assert next_version([]) == "0.1.0"
    assert next_version(["0.1.0", "0.1.10", "0.1.9"]) == "0.1.11"


@pytest.mark.parametrize(
    "path, mode, words",
    [
        ("../escape.py", "100644", "escapes the checkout"),
        ("/tmp/abs.py", "100644", "absolute path"),
        ("python/link", "120000", "symlink"),
    ],
)
def test_verify_refuses_unsafe_sets_before_applying(patches_root, pristine_base, path, mode, words):
    from deployer.patchset.local_git import git_out

    data = new_file_patch(path, mode=mode).replace(b"a//tmp", b"/tmp").replace(b"b//tmp", b"/tmp")
    write_raw_set(patches_root / "0.1.0", {"0001-ddtree-evil.patch": data}, tree=pristine_base.tree)
    head = git_out(pristine_base.path, "rev-parse", "HEAD")
    r = run_main("patches", "verify", "0.1.0", "--no-tests")
    assert r.code == 4
    assert r.stderr.startswith("ddeploy: error: patch 0001-ddtree-evil.patch:") and words in r.stderr
    assert "clean" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert git_out(pristine_base.path, "rev-parse", "HEAD") == head
    assert git_out(pristine_base.path, "status", "--porcelain") == ""


def test_verify_refuses_a_flipped_byte(patches_root, pristine_base):
    d = write_raw_set(
        patches_root / "0.1.0", {"0001-ddtree-ok.patch": new_file_patch("python/ok.py")}, tree=pristine_base.tree
    )
    raw = bytearray((d / "0001-ddtree-ok.patch").read_bytes())
    raw[10] ^= 0x20
    (d / "0001-ddtree-ok.patch").write_bytes(bytes(raw))
    r = run_main("patches", "verify", "0.1.0", "--no-tests")
    assert r.code == 4
    assert "patch 0001-ddtree-ok.patch" in r.stderr and "was modified: sha256" in r.stderr


def test_verify_refuses_a_set_made_for_another_base(patches_root, pristine_base):
    write_raw_set(patches_root / "0.1.0", {"0001-ddtree-ok.patch": new_file_patch("python/ok.py")}, tree="0" * 40)
    r = run_main("patches", "verify", "--no-tests")
    assert r.code == 11  # ExitCode.BASE_TREE: not the patch set, the base it was made for
    assert f"was made for base tree {'0' * 40}, but the SGLang 0.5.23 base is {pristine_base.tree}" in r.stderr


def test_asymmetric_diff_git_line_reports_the_full_unsafe_path():
    with pytest.raises(PathSafetyError, match=r"patch p: path '\.\./\.\./\.bashrc' escapes"):
        patch_paths(b"diff --git a/x.py b/../../.bashrc\n", patch="p")
