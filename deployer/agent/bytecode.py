"""The bytecode the agent's Python runs (pytest, the kernel build) keep under .git/ddeploy/pycache
(PYTHONPYCACHEPREFIX), and dropping it for the files a push rewrites.

Python reuses a .pyc while its source's mtime (whole seconds) and size match. A push that rewrites
a file within the second of the last run, to the same size (an edit of one character in the dev
loop), would be served the old code; so a push drops the bytecode of every file it switched."""

import os


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
