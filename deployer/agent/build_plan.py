"""What `ddeploy build` would do, from the host's facts (applied set, python, GPU, toolkit,
kernel sources): the build key, the cache directory, build or noop and why; writes nothing."""

import hashlib
import json
import os

from .common import Fail, last_text_line, run_tool
from .jit_cache import DEFAULT_CACHE_ROOT, cache_has_build, expand_home
from .repo import Repo
from .state import read_state
from .toolkit import check_gpus_match, check_toolkit_supports, probe_gpus, probe_toolkit, resolve_cuda_home

# The kernel-build concern's sources (tests excluded): what a rebuild depends on.
KERNEL_DIR = "python/sglang/kernels/jit"


KERNEL_FILES = ["python/sglang/srt/speculative/ddtree_kernel.py", "python/sglang/srt/speculative/ddtree_build.py"]


def kernel_source_hash(checkout: str):
    """sha256 over `sha256sum`-style lines of the kernel sources (sorted paths), or None without any."""
    found = []
    for root, _dirs, names in os.walk(os.path.join(checkout, KERNEL_DIR)):
        found += [os.path.relpath(os.path.join(root, n), checkout) for n in names if n.startswith("ddtree")]
    found += [f for f in KERNEL_FILES if os.path.isfile(os.path.join(checkout, f))]
    if not any(f.startswith(KERNEL_DIR) for f in found):
        return None
    lines = []
    for rel in sorted(set(found)):
        with open(os.path.join(checkout, rel), "rb") as fh:
            lines.append("%s  %s\n" % (hashlib.sha256(fh.read()).hexdigest(), rel))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


# What a kernel build compiles and links against besides the sources and nvcc: a new torch (its
# headers and ABI), flashinfer (speculative_sampling's headers) or tvm-ffi (SGLang's JIT loader)
# needs a new build, so their versions are part of the build key.
BUILD_PACKAGES = ("torch", "flashinfer-python", "apache-tvm-ffi")


_PYTHON_PROBE = """import importlib.util as u, json
from importlib import metadata
s = u.find_spec("sglang")
versions = {}
for name in %r:
    try:
        versions[name] = metadata.version(name)
    except Exception:
        versions[name] = None
print(json.dumps({"sglang": s.submodule_search_locations[0] if s and s.submodule_search_locations else "",
                  "packages": versions}))
""" % (BUILD_PACKAGES,)


def probe_python(target: dict, checkout: str) -> dict:
    """The host python must import sglang from this checkout (an editable install), not elsewhere;
    the versions of BUILD_PACKAGES it has ({name: version or None})."""
    rc, out, err = run_tool([target["python"], "-c", _PYTHON_PROBE], cwd="/")
    if rc != 0:
        raise Fail(
            "BuildError",
            "cannot run the host python %s (from %s): %s"
            % (target["python"], target["source"], last_text_line(err, default="exit %d" % rc)),
        )
    try:
        facts = json.loads(out.strip().splitlines()[-1])
        got, packages = str(facts["sglang"]), dict(facts["packages"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise Fail(
            "BuildError", "the host python %s printed %r, not what it was asked" % (target["python"], out[-200:])
        ) from None
    want = checkout.rstrip("/") + "/python/sglang"
    if not got:
        raise Fail(
            "BuildError",
            "%s cannot import sglang; install the checkout into it (pip install -e %s/python)"
            % (target["python"], checkout),
        )
    if os.path.realpath(got) != os.path.realpath(want):
        raise Fail(
            "BuildError",
            "%s imports sglang from %s, not from the checkout %s; install the checkout "
            "editable (pip install -e %s/python)" % (target["python"], got, want, checkout),
        )
    return packages


def packages_text(packages: dict) -> str:
    return ", ".join("%s %s" % (name, packages.get(name) or "-") for name in BUILD_PACKAGES)


def plan_build(repo: Repo, req: dict) -> dict:
    """Facts (applied set, python, GPU, toolkit, sources) -> what a build would do; writes nothing."""
    target, opts = req["target"], req.get("options", {})
    _c, state = read_state(repo)
    applied = state.get("applied")
    if not applied:
        raise Fail(
            "BuildError",
            "no patch set is applied to %s; push one first (ddeploy push --host %s)" % (repo.path, target["name"]),
        )
    packages = probe_python(target, repo.path)
    gpu = check_gpus_match(target, probe_gpus())
    toolkit = probe_toolkit(target, resolve_cuda_home(target))
    check_toolkit_supports(target, toolkit)
    source_hash = kernel_source_hash(repo.path)
    if source_hash is None:
        raise Fail(
            "BuildError", "no DDTree kernel sources under %s/%s; is the patch set applied?" % (repo.path, KERNEL_DIR)
        )
    major, minor = target["capability"]
    plan = {
        "host": target["name"],
        "arch": "sm_%d%d" % (major, minor),
        "capability": [major, minor],
        "toolkit": {"cuda_home": toolkit.cuda_home, "nvcc": toolkit.version_text},
        "source_hash": source_hash,
        "version": applied.get("version", "?"),
        "gpu": gpu,
        "cache_dir": "%s/%s" % (expand_home(target.get("cache_root") or DEFAULT_CACHE_ROOT), source_hash[:16]),
        "packages": packages,
        "action": "build",
        "reason": "",
    }
    built_with, with_packages = "%s|%s|%s" % (source_hash, plan["arch"], toolkit.version_text), packages_text(packages)
    plan["key"] = "%s|%s" % (built_with, with_packages)
    current = (state.get("builds") or {}).get(plan["arch"]) or {}
    known = current.get("known") or {}
    plan["previous_cache_dir"] = current.get("cache_dir")
    if opts.get("force"):
        plan["reason"] = "--force"
    elif plan["key"] not in known and any(k.startswith(built_with + "|") for k in known):
        plan["reason"] = "the host's python packages changed since the last build (now %s)" % with_packages
    elif plan["key"] not in known:
        plan["reason"] = "no build for these kernel sources, arch and nvcc yet"
    elif not cache_has_build(plan["cache_dir"], plan["capability"]):
        plan["reason"] = "the recorded build is gone from %s" % plan["cache_dir"]
    else:
        prior = known[plan["key"]]
        plan["action"] = "noop"
        plan["reason"] = "already built for these sources (version %s, %s)" % (
            prior.get("version", "?"),
            prior.get("at", "?"),
        )
    return plan
