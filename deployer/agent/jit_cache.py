"""The JIT cache a kernel build fills: one directory per kernel-source hash under the cache
root, checked for a build, cleared for --force, seeded with SGLang's own modules."""

import os
import subprocess

DEFAULT_CACHE_ROOT = "$HOME/.cache/ddeploy/jit"


DDTREE_MODULE = "sgl_kernel_jit_speculative_ddtree"


def expand_home(root: str) -> str:
    """A leading ~ or $HOME of the JIT cache root is expanded on the host (nothing else is)."""
    home = os.environ.get("HOME", "")
    for prefix in ("~", "$HOME"):
        if root == prefix or root.startswith(prefix + "/"):
            return (home + root[len(prefix) :]).rstrip("/")
    return root.rstrip("/")


def cache_has_build(cache_dir: str, capability) -> bool:
    import glob

    pattern = "sm%d%d*/%s/build-*/deps-*/*.so" % (capability[0], capability[1], DDTREE_MODULE)
    return any(os.path.isfile(p) for p in glob.glob(os.path.join(glob.escape(cache_dir), pattern)))


def drop_arch_cache(plan: dict) -> None:
    """--force: SGLang keeps an existing leaf even when told to recompile, so start from nothing."""
    import glob
    import shutil

    pattern = "sm%d%d*" % tuple(plan["capability"])
    for d in glob.glob(os.path.join(glob.escape(plan["cache_dir"]), pattern)):
        if os.path.isdir(d) and not os.path.islink(d):
            shutil.rmtree(d)


def seed_cache(plan: dict) -> None:
    """Hard-link SGLang's own modules from the previous build: they do not include the overlay's
    kernel sources, and their cache leaves are immutable and self-verifying."""
    import glob

    previous = plan.get("previous_cache_dir")
    if not previous or previous == plan["cache_dir"] or not os.path.isdir(previous):
        return
    pattern = "sm%d%d*/sgl_kernel_jit_*" % tuple(plan["capability"])
    for src in glob.glob(os.path.join(glob.escape(previous), pattern)):
        rel = os.path.relpath(src, previous)
        dst = os.path.join(plan["cache_dir"], rel)
        if rel.endswith("/" + DDTREE_MODULE) or not os.path.isdir(src) or os.path.exists(dst):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        subprocess.run(["cp", "-al", src, dst], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
