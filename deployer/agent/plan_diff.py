"""`plan --diff`: the unified diff push would make, from HEAD's tree to the series applied in a
throwaway index (nothing written)."""

import os

from .patch_files import Scratch
from .repo import Repo

DIFF_LIMIT = 512 * 1024  # bytes of diff text sent back per host; the rest is cut at a line end


DIFF_ARGS = ("diff", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames", "--binary")


def series_tree(repo: Repo, pre: str, patches: list, three_way: bool):
    """The tree push would commit: the series applied to pre in a throwaway index; None if it fails."""
    with Scratch("ddeploy-diff-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp.path, "index")}
        repo.run("read-tree", pre, env=env)
        for _name, path, _sha, _files in patches:
            args = ["apply", "--cached"] + (["--3way"] if three_way else []) + [path]
            if repo.run(*args, env=env, check=False).returncode != 0:
                return None
        p = repo.run("write-tree", env=env, check=False)
        return p.stdout.decode().strip() if p.returncode == 0 else None


def plan_diff(repo: Repo, req: dict, f: dict, p: dict, patches: list) -> dict:
    """The unified diff from HEAD's tree to the tree push would switch to, over the set's files
    and the applied set's files (hand edits in the work tree are the plan's drift, not diffed)."""
    applied = f["state"].get("applied") or {}
    files = sorted(set(req["set"]["files"]) | set(applied.get("files", [])))
    out = {"files": [], "text": "", "bytes": 0, "truncated": False, "note": None}
    if p["action"] in ("noop", "restore"):
        target = applied["head"] + "^{tree}"
    else:
        target = series_tree(repo, p["pre_deploy"], patches, req.get("options", {}).get("three_way", False))
    if target is None:
        return dict(out, text=None, note="no diff: the series does not apply on %s" % p["pre_deploy"][:12])
    names = repo.out("diff", "--no-renames", "--name-only", "-z", f["head"], target, "--", *files)
    out["files"] = [n for n in names.split("\0") if n]
    if not out["files"]:
        return out
    raw = repo.run(*DIFF_ARGS, f["head"], target, "--", *files).stdout
    out["bytes"] = len(raw)
    if len(raw) > DIFF_LIMIT:
        raw, out["truncated"] = raw[: raw.rfind(b"\n", 0, DIFF_LIMIT) + 1], True
    out["text"] = raw.decode(errors="replace")
    return out
