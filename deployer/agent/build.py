"""`ddeploy build`: the DDTree and SGLang verify kernels compiled in place for the host's arch
(the plan in build_plan.py), recorded in the state (section builds)."""

import json
import os
import subprocess
import sys

from .build_plan import kernel_source_hash, plan_build
from .common import Fail, now, progress
from .jit_cache import drop_arch_cache, seed_cache
from .lock import holding
from .repo import Repo
from .state import update_section

PREBUILD_MODULE = "sglang.srt.speculative.ddtree_build"


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
    options.reuse_only: never compile, only make an existing build of these sources current again.
    The compile runs under the checkout's lock."""
    return run_build(repo, req, lambda: holding(repo, req))


def run_build(repo: Repo, req: dict, lock) -> dict:
    """op_build with `lock()` the context the compile runs in: the lock's hold, or nothing for a
    caller that holds it already (push-build)."""
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
    with lock():
        summary = compile_kernels(repo, req, plan)
    progress(serve_hint(plan))
    return {"ok": True, "changed": True, "plan": plan, "build": summary}


def compile_kernels(repo: Repo, req: dict, plan: dict) -> dict:
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
    return summary


def op_sources(repo: Repo, req: dict) -> dict:
    return {"ok": True, "source_hash": kernel_source_hash(repo.path)}
