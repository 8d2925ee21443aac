"""`ddeploy build`: the DDTree and SGLang verify kernels compiled in place for the host's arch
(toolkit and GPU probes, the build key, the JIT cache), recorded in the state (section builds)."""

import hashlib
import json
import os
import re
import subprocess
import sys

from .common import Fail, last_text_line, now, progress, run_tool
from .lock import acquire, release
from .repo import Repo
from .state import read_state, update_section


# Minimum nvcc per arch (archs not listed rely on `nvcc --list-gpu-arch`).
MIN_NVCC = {(9, 0): (11, 8), (10, 0): (12, 8), (12, 0): (12, 8), (10, 3): (12, 9), (12, 1): (12, 9), (11, 0): (13, 0)}


# The kernel-build concern's sources (tests excluded): what a rebuild depends on.
KERNEL_DIR = "python/sglang/kernels/jit"


KERNEL_FILES = ["python/sglang/srt/speculative/ddtree_kernel.py", "python/sglang/srt/speculative/ddtree_build.py"]


DEFAULT_CACHE_ROOT = "$HOME/.cache/ddeploy/jit"


PREBUILD_MODULE = "sglang.srt.speculative.ddtree_build"


DDTREE_MODULE = "sgl_kernel_jit_speculative_ddtree"


class Toolkit:
    def __init__(self, cuda_home: str, version: tuple, archs):
        self.cuda_home, self.version, self.archs = cuda_home, tuple(version), archs

    @property
    def version_text(self) -> str:
        return "%d.%d" % self.version


def parse_nvidia_smi(text: str) -> list:
    """`name, compute_cap` CSV lines (noheader) -> [(name, (major, minor))]."""
    gpus = []
    for line in text.strip().splitlines():
        name, _, cap = line.rpartition(",")
        m = re.match(r"\s*(\d+)\.(\d+)\s*\Z", cap)
        if not name.strip() or not m:
            raise Fail("BuildError", "cannot read nvidia-smi output line %r (expected 'name, compute_cap')" % line)
        gpus.append((name.strip(), (int(m.group(1)), int(m.group(2)))))
    return gpus


def parse_nvcc_version(text: str):
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_gpus_match(target: dict, gpus):
    """The inventory's arch against nvidia-smi's (None where the host has no nvidia-smi)."""
    if not gpus:
        return None
    want = tuple(target["capability"])
    for name, cap in gpus:
        if cap != want:
            raise Fail(
                "BuildError",
                "inventory says gpu.arch %s (%s) in %s, but nvidia-smi reports %s, compute "
                "capability %d.%d (sm_%d%d); fix gpu.arch in the inventory"
                % (target["arch"], target["model"], target["source"], name, cap[0], cap[1], cap[0], cap[1]),
            )
    return gpus[0][0]


def probe_gpus():
    rc, out, err = run_tool(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
    if rc == 127:
        return None
    if rc != 0:
        raise Fail("BuildError", "nvidia-smi failed (exit %d): %s" % (rc, last_text_line(err)))
    return parse_nvidia_smi(out)


def resolve_cuda_home(target: dict) -> str:
    """CUDA_HOME from the inventory, else /usr/local/cuda, else the toolkit of the nvcc on PATH."""
    if target.get("cuda_home"):
        return target["cuda_home"]
    if os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        return "/usr/local/cuda"
    import shutil

    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise Fail(
            "BuildError",
            "no CUDA toolkit found (no CUDA_HOME in %s, no /usr/local/cuda, no nvcc on PATH); "
            "install CUDA >= 12.8 or set env.CUDA_HOME" % target["source"],
        )
    real = os.path.realpath(nvcc)
    try:  # a wrapper script (exec /path/bin/nvcc "$@") names the real toolkit
        with open(real, errors="replace") as fh:
            m = re.search(r"^exec (/\S*/bin/nvcc) ", fh.read(4096), re.M)
        real = m.group(1) if m else real
    except OSError:
        pass
    return os.path.dirname(os.path.dirname(real))


def probe_toolkit(target: dict, cuda_home: str) -> Toolkit:
    nvcc = cuda_home.rstrip("/") + "/bin/nvcc"
    rc, out, _err = run_tool([nvcc, "--version"])
    if rc != 0:
        where = "CUDA_HOME=%s%s" % (cuda_home, " from %s" % target["source"] if target.get("cuda_home") else "")
        raise Fail(
            "BuildError",
            "no working nvcc at %s (%s; exit %d); install the CUDA toolkit (>= 12.8 for "
            "Blackwell) or point env.CUDA_HOME at one" % (nvcc, where, rc),
        )
    version = parse_nvcc_version(out)
    if version is None:
        raise Fail("BuildError", "cannot read the version from `%s --version`: %r" % (nvcc, out.strip()[-200:]))
    rc, listed, _err = run_tool([nvcc, "--list-gpu-arch"])
    archs = frozenset(re.findall(r"compute_\d+[af]?", listed)) if rc == 0 else None
    return Toolkit(cuda_home, version, archs or None)


def check_toolkit_supports(target: dict, toolkit: Toolkit) -> None:
    major, minor = target["capability"]
    arch = "sm_%d%d" % (major, minor)
    need = MIN_NVCC.get((major, minor))
    nvcc = "%s/bin/nvcc" % toolkit.cuda_home
    if need and toolkit.version < need:
        raise Fail(
            "BuildError",
            "%s needs nvcc >= %d.%d, but %s is %s; install a newer CUDA toolkit on the host "
            "or point env.CUDA_HOME at one" % (arch, need[0], need[1], nvcc, toolkit.version_text),
        )
    if toolkit.archs is not None and "compute_%d%d" % (major, minor) not in toolkit.archs:
        listed = " ".join(sorted(toolkit.archs, key=lambda a: int(re.sub(r"\D", "", a))))
        raise Fail(
            "BuildError",
            "nvcc %s at %s cannot build %s (its --list-gpu-arch: %s); use a toolkit that "
            "supports %s" % (toolkit.version_text, nvcc, arch, listed, arch),
        )


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


def record_build(repo: Repo, plan: dict, summary, ok: bool) -> None:
    """builds[arch] = this build (ok or not) plus `known`: every good build by cache key."""
    record = {
        "ok": ok,
        "nvcc": plan["toolkit"]["nvcc"],
        "cuda_home": plan["toolkit"]["cuda_home"],
        "source_hash": plan["source_hash"],
        "cache_dir": plan["cache_dir"],
        "version": plan["version"],
        "at": now(),
        "modules": [
            {k: m.get(k) for k in ("module", "status", "seconds", "path", "reason")}
            for m in (summary or {}).get("modules", [])
        ],
    }

    def change(builds):
        builds = dict(builds or {})
        known = dict((builds.get(plan["arch"]) or {}).get("known") or {})
        if ok:
            known[plan["key"]] = {k: v for k, v in record.items() if k != "ok"}
        builds[plan["arch"]] = dict(record, known=known)
        return builds

    update_section(repo, "builds", change, "build %s %s" % (plan["arch"], plan["source_hash"][:12]))


def record_reuse(repo: Repo, plan: dict) -> None:
    """A no-op build of sources built before (e.g. after a rollback): make that build current again."""

    def change(builds):
        builds = dict(builds or {})
        entry = builds.get(plan["arch"]) or {}
        if entry.get("ok") and (entry.get("source_hash"), entry.get("version")) == (
            plan["source_hash"],
            plan["version"],
        ):
            return builds
        known = entry.get("known") or {}
        # `version` is the applied set this build now serves (launch looks it up by version).
        builds[plan["arch"]] = dict(known[plan["key"]], ok=True, version=plan["version"], known=known)
        return builds

    update_section(repo, "builds", change, "build %s %s (cached)" % (plan["arch"], plan["source_hash"][:12]))


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


def run_prebuild(repo: Repo, target: dict, plan: dict) -> dict:
    """The prebuild in the host's python env; its stderr is streamed, its stdout is a JSON summary."""
    major, minor = plan["capability"]
    argv = [
        target["python"],
        "-m",
        PREBUILD_MODULE,
        "--arch",
        "%d.%d" % (major, minor),
        "--cache-dir",
        plan["cache_dir"],
        "--json",
    ]
    # Bytecode goes into the checkout's .git so the work tree stays clean (no drift).
    env = dict(
        os.environ, CUDA_HOME=plan["toolkit"]["cuda_home"], PYTHONPYCACHEPREFIX=os.path.join(repo.ddir, "pycache")
    )
    sys.stderr.flush()
    try:
        p = subprocess.run(argv, cwd=repo.path, env=env, stdout=subprocess.PIPE, stderr=None)
        rc, out = p.returncode, p.stdout.decode(errors="replace")
    except OSError as exc:
        rc, out = 127, ""
        progress("%s: %s" % (target["python"], exc.strerror))
    try:
        summary = json.loads(out)
    except ValueError:
        summary = None
    if rc != 0 or not isinstance(summary, dict):
        failed = [m for m in (summary or {}).get("modules", []) if m.get("status") == "failed"]
        detail = (
            "%s: %s" % (failed[0]["module"], failed[0].get("reason", "")[-300:]) if failed else "see the output above"
        )
        raise Fail("BuildError", "kernel build for %s failed (exit %d): %s" % (plan["arch"], rc, detail))
    return summary


def serve_hint(plan: dict) -> str:
    return (
        "serve with the prebuilt kernels: SGLANG_JIT_CACHE_DIR=%s SGLANG_CRASH_ON_JIT_COMPILE=1 "
        "python -m sglang.launch_server ..." % plan["cache_dir"]
    )


def announce(plan: dict) -> None:
    gpu = " (%s, checked with nvidia-smi)" % plan["gpu"] if plan["gpu"] else " (from the inventory)"
    progress(
        "arch %s%s, nvcc %s at %s, sources %s"
        % (plan["arch"], gpu, plan["toolkit"]["nvcc"], plan["toolkit"]["cuda_home"], plan["source_hash"][:12])
    )


def op_build(repo: Repo, req: dict) -> dict:
    """Plan and (unless it is a no-op) run the kernel build; records it in the state (section builds).
    options.reuse_only: never compile, only make an existing build of these sources current again."""
    plan = plan_build(repo, req)
    if req.get("options", {}).get("reuse_only") and plan["action"] != "noop":
        return {"ok": True, "changed": False, "plan": plan, "build": None}
    announce(plan)
    if plan["action"] == "noop":
        record_reuse(repo, plan)
        progress("nothing to build: %s" % plan["reason"])
        progress(serve_hint(plan))
        return {"ok": True, "changed": False, "plan": plan, "build": None}
    progress("building (%s) into %s" % (plan["reason"], plan["cache_dir"]))
    acquire(repo, req)
    try:
        if req.get("options", {}).get("force"):
            drop_arch_cache(plan)
        else:
            seed_cache(plan)
        try:
            summary = run_prebuild(repo, req["target"], plan)
        except Fail:
            record_build(repo, plan, None, ok=False)
            raise
        record_build(repo, plan, summary, ok=True)
    finally:
        release(repo)
    progress(serve_hint(plan))
    return {"ok": True, "changed": True, "plan": plan, "build": summary}


def op_sources(repo: Repo, req: dict) -> dict:
    return {"ok": True, "source_hash": kernel_source_hash(repo.path)}
