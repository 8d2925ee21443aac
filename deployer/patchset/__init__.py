"""Patch sets, from the editable overlay to a verified release:

overlay.py       the overlay's concerns.yaml: which files and hunks make each patch
export.py        overlay -> released set (one git-format patch per concern, series, manifest)
release.py       a released set on disk, loaded and verified (PatchSet, load_patch_set)
archive.py       the release window: older releases archived (archive.yaml, tags), restored from git
path_safety.py   refuses patch paths outside the checkout (absolute, .., .git/, symlinks)
verify.py        `patches verify`: strict apply to a base clone, reverse check, overlay tests
snapshot.py      dev snapshots: the overlay's working copy as an unreleased, cached set
compare.py       `patches diff`: what changed between two released sets, per patch
sglang_base.py   the pristine SGLang base git repository, built from the PyPI wheel
local_git.py     git on this machine with a clean, reproducible environment
"""

from .release import PatchSet, list_versions, load_patch_set, resolve_dir, sets_root

__all__ = ["PatchSet", "list_versions", "load_patch_set", "resolve_dir", "sets_root"]
