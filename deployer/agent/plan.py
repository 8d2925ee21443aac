"""`ddeploy plan` and the plan push executes: what a set would do to a checkout (noop, apply,
replace, restore), the series dry-run in a throwaway index, and what blocks it (hand edits,
things in the way, the base gate, a conflict)."""

import os

from .base_gate import check_base, need_merge_base, tree_blobs
from .facts import facts
from .patch_files import Scratch, load_patches
from .plan_diff import plan_diff
from .repo import Repo


def apply_error(raw: bytes) -> str:
    lines = [ln for ln in raw.decode(errors="replace").strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["failed"])[0]


def check_series(repo: Repo, pre: str, patches: list, three_way: bool) -> list:
    """Dry-run the whole series on a throwaway index (nothing written); returns per-patch results."""
    with Scratch("ddeploy-plan-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp.path, "index")}
        repo.run("read-tree", pre, env=env)
        results, paths = [], []
        for name, path, _sha, files in patches:
            paths.append(path)
            p = repo.run("apply", "--cached", "--check", *paths, env=env, check=False)
            err = apply_error(p.stderr)
            results.append(
                {"name": name, "files": files, "ok": p.returncode == 0, "error": None if p.returncode == 0 else err}
            )
            if p.returncode != 0:
                if three_way:
                    results[-1]["error"] += " (a 3-way merge will be attempted)"
                break
        return results


def in_the_way(repo: Repo, head: str, files: list, tracked=None) -> list:
    """Untracked (or ignored) things on disk where a switch to these files must write: a file,
    link or directory at a path that head lacks, or a non-directory where one of its parent
    directories must be. git status does not see the second kind, and a checkout deletes both.
    `tracked`: tree_blobs of head for (at least) these files, if the caller has them."""
    tracked = set(tree_blobs(repo, head, list(files)) if tracked is None else tracked)
    found = set()
    for path in files:
        if path in tracked:
            continue
        full = os.path.join(repo.path, path)
        if os.path.lexists(full):
            found.add(path)
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            full = os.path.join(repo.path, parent)
            if os.path.islink(full) or (os.path.lexists(full) and not os.path.isdir(full)):
                if not repo.rev("%s:%s" % (head, parent)):  # a tracked one is git apply's to refuse
                    found.add(parent)
                break
    return sorted(found)


def describe_drift(drift: list, blocking: list) -> str:
    """`hand edits in a, b; in the way: test (untracked, where the set writes)`, five names at most."""
    edits = [d for d in drift if d not in blocking]
    parts = ["hand edits in %s" % ", ".join(edits[:5])] if edits else []
    if blocking:
        parts.append("in the way: %s (untracked, where the set writes)" % ", ".join(blocking[:5]))
    return "; ".join(parts)


def plan(repo: Repo, req: dict, f: dict, patches: list, series: bool = True) -> dict:
    """What pushing the set would do, and what blocks it. `series`: also dry-run the patches
    (out["patches"]); push leaves that to the commits it builds, the same strict apply."""
    spec, opts = req["set"], req.get("options", {})
    state = f["state"]
    applied = state.get("applied")
    pre = (state.get("pre_deploy") or {}).get("commit") or f["head"]
    out = {
        "version": spec["version"],
        "from": applied and applied["version"],
        "pre_deploy": pre,
        "files": spec["files"],
        "patches": [],
        "drift": [],
        "blocked": None,
        "blocked_kind": None,
        "base": None,
        "head": f["head"],
    }
    if applied and applied.get("fingerprint") == spec["fingerprint"] and applied["head"] == f["head"]:
        out["action"] = "noop"
    else:
        out["action"] = "replace" if applied else "apply"
    relevant = set(spec["files"]) | set((applied or {}).get("files", []))
    preimages = spec.get("preimages") or {}
    # One `git ls-tree` of HEAD for both the set's files and the base gate's (at pre, if that
    # is HEAD: a first push).
    at_head = tree_blobs(repo, f["head"], sorted(set(spec["files"]) | (set(preimages) if pre == f["head"] else set())))
    blocking = out["in_the_way"] = in_the_way(repo, f["head"], spec["files"], at_head)
    out["drift"] = sorted(set(repo.dirty(relevant)) | set(blocking))
    if applied and f["head"] != applied["head"]:
        out["drift"].insert(0, "HEAD moved since %s was applied" % applied["version"])
    if out["drift"] and not opts.get("force"):
        out["blocked"] = describe_drift(out["drift"], blocking)
        out["blocked_kind"] = "DriftError"
    if out["action"] != "noop":
        out["base"] = check_base(repo, pre, preimages, spec, at_head if pre == f["head"] else None)
        mismatched = out["base"]["mismatched"]
        if mismatched and not opts.get("three_way"):
            more = " (and %d more file(s))" % (len(mismatched) - 1) if len(mismatched) > 1 else ""
            out["blocked"] = out["blocked"] or "%s%s" % (mismatched[0]["why"], more)
            out["blocked_kind"] = out["blocked_kind"] or "BaseTreeError"
        elif mismatched:
            need_merge_base(repo, mismatched)
        if series:
            out["patches"] = check_series(repo, pre, patches, opts.get("three_way", False))
        bad = [p for p in out["patches"] if not p["ok"]]
        if bad and not opts.get("three_way"):
            out["blocked"] = out["blocked"] or "patch %s does not apply: %s" % (bad[0]["name"], bad[0]["error"])
            out["blocked_kind"] = out["blocked_kind"] or "ConflictError"
    elif out["drift"] and opts.get("force"):
        out["action"] = "restore"  # same version, hand edits saved then reverted to the applied content
    return out


def op_plan(repo: Repo, req: dict) -> dict:
    with Scratch("ddeploy-plan-") as workdir:
        patches = load_patches(req, workdir)
        f = facts(repo)
        p = plan(repo, req, f, patches)
        out = {"ok": True, "plan": p, "facts": f}
        if req.get("options", {}).get("diff"):
            out["diff"] = plan_diff(repo, req, f, p, patches)
        return out
