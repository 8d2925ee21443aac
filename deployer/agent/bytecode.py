"""The bytecode the agent's Python runs (pytest, the kernel build) keep under .git/ddeploy/pycache
(PYTHONPYCACHEPREFIX), and dropping it for the files a push rewrites.

Python reuses a .pyc while its source's mtime (whole seconds) and size match. A push that rewrites
a file within the second of the last run, to the same size (an edit of one character in the dev
loop), would be served the old code; so a push (or rollback) drops the bytecode of every file
whose content it changed. The files it leaves as they were keep theirs: recompiling the whole
overlay's modules on every dev-loop round cost its tests ~0.5 s."""

import os
from hashlib import sha256


def pycache_dir(repo) -> str:
    return os.path.join(repo.ddir, "pycache")


def drop_bytecode(repo, files) -> None:
    """Remove the cached bytecode of these checkout-relative files (any Python version)."""
    prefix = pycache_dir(repo)
    for rel in files:
        if not rel.endswith(".py"):
            continue
        source_dir = os.path.dirname(os.path.abspath(os.path.join(repo.path, rel)))
        cached = os.path.join(prefix, source_dir.lstrip(os.sep))
        stem = os.path.basename(rel)[: -len(".py")] + "."
        try:
            names = os.listdir(cached)
        except OSError:
            continue
        for name in names:
            if name.startswith(stem) and name.endswith(".pyc"):
                try:
                    os.unlink(os.path.join(cached, name))
                except OSError:
                    pass


def contents(repo, files) -> dict:
    """{checkout-relative .py file: the sha256 of its content, None when there is none}."""
    out = {}
    for rel in files:
        if rel.endswith(".py"):
            try:
                with open(os.path.join(repo.path, rel), "rb") as fh:
                    out[rel] = sha256(fh.read()).hexdigest()
            except OSError:
                out[rel] = None
    return out


def drop_changed(repo, before: dict) -> None:
    """Drop the bytecode of the files whose content is no longer what `before` (contents) says."""
    after = contents(repo, before)
    drop_bytecode(repo, [rel for rel, digest in before.items() if after[rel] != digest])
