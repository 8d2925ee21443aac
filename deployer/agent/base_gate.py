"""The base gate: every file a set touches must hold, at the pre-deploy commit, exactly the
blob its patches were made against (and that blob must be in the object store)."""

from .common import Fail
from .repo import Repo


def tree_blobs(repo: Repo, commit: str, paths: list) -> dict:
    """{path: blob id} of these paths in commit's tree (absent paths left out)."""
    if not paths:
        return {}
    raw = repo.run("ls-tree", "-r", "-z", commit, "--", *paths).stdout.decode(errors="surrogateescape")
    out = {}
    for entry in raw.split("\0"):
        if "\t" in entry:
            meta, path = entry.split("\t", 1)
            out[path] = meta.split()[2]
    return out


def missing_objects(repo: Repo, ids: list) -> list:
    """The object ids of `ids` that this repository's object store lacks (no lazy fetch)."""
    if not ids:
        return []
    query = "".join(i + "\n" for i in ids).encode()
    p = repo.run("cat-file", "--batch-check", input=query, env={"GIT_NO_LAZY_FETCH": "1"})
    return [line.split()[0] for line in p.stdout.decode().splitlines() if line.endswith(" missing")]


def check_base(repo: Repo, commit: str, preimages: dict, spec: dict, have=None) -> dict:
    """Does every file the set touches hold, in commit, exactly what the patches expect?

    preimages: {path: blob id (full or abbreviated) or None for a file the set creates}, in
    series order, from the patches' index lines. `have`: tree_blobs of commit for (at least)
    these paths, if the caller has them. Returns {commit, against, checked, mismatched: [{path,
    why, expected, actual}]} (series order). Raises when a matching blob is not in the object
    store (a partial or shallow clone that lacks it): git apply could not read it.
    """
    have = tree_blobs(repo, commit, list(preimages)) if have is None else have
    against = "%s %s" % (spec.get("name", "the set"), spec.get("version", "")) if spec else "the set"
    mismatched, present = [], []
    for path, want in preimages.items():
        got = have.get(path)
        if want is None and got is None:
            continue
        if want is not None and got is not None and got.startswith(want):
            present.append(got)
            continue
        if want is None:
            why = "%s already exists in the checkout (%s creates it)" % (path, against)
        elif got is None:
            why = "%s is missing from the checkout (%s edits it)" % (path, against)
        else:
            why = "%s is not the SGLang %s version that %s expects (blob %s, the checkout has %s)" % (
                path,
                spec.get("base_version", "base"),
                against,
                want[:12],
                got[:12],
            )
        mismatched.append({"path": path, "why": why, "expected": want, "actual": got})
    lost = missing_objects(repo, present)
    if lost:
        path = next(p for p, b in have.items() if b == lost[0])
        raise Fail(
            "BaseTreeError",
            "%s: the content of %s (blob %s) is not in the object store (a partial or shallow clone); "
            "fetch it (git -C %s fetch --refetch, or --unshallow) and push again; nothing was changed"
            % (repo.path, path, lost[0][:12], repo.path),
        )
    return {"commit": commit, "against": against, "checked": len(preimages), "mismatched": mismatched}


def need_merge_base(repo: Repo, mismatched: list) -> None:
    """--3way merges a mismatching file from the blob the patch was made against: it must be here."""
    lost = set(missing_objects(repo, [m["expected"] for m in mismatched if m["expected"]]))  # one git call
    for m in mismatched:
        if m["expected"] in lost:
            raise Fail(
                "BaseTreeError",
                "%s: cannot 3-way merge %s: the base blob %s the patch was made against is not in this "
                "checkout (a shallow clone?); fetch more history (git -C %s fetch --unshallow) and push "
                "again; nothing was changed" % (repo.path, m["path"], m["expected"][:12], repo.path),
            )
