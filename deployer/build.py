"""`ddeploy build`: compile the DDTree JIT kernels in place on a host, for the host's GPU arch.

Facts first, then a plan, then the build:
  * arch: the inventory's gpu.arch, cross-checked with `nvidia-smi --query-gpu=name,compute_cap`
    where the host has one (a mismatch names both);
  * toolkit: CUDA_HOME (inventory env, else /usr/local/cuda, else the nvcc on PATH), `nvcc
    --version` and `--list-gpu-arch`; sm_100/sm_120 need nvcc >= 12.8, sm_103 >= 12.9;
  * source hash: sha256 over the checkout's kernel-build sources (the files of the patch set's
    "kernel" concern that are not tests);
  * the applied patch set (refused when none) and the host python's `sglang` location.
The build cache key is (source hash, arch, nvcc version); each source hash has its own JIT cache
directory (`<root>/<hash[:16]>`, root = the inventory env DDEPLOY_JIT_CACHE_ROOT, default
~/.cache/ddeploy/jit on the host), so after a rollback the other version's build is still there
and a build of it is a no-op. The prebuild runs in the host's python env
(`python -m sglang.srt.speculative.ddtree_build`), its output streamed as `[host] ...`, and the
result is recorded in the host's state (section "builds", per arch) for `ddeploy status`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .connection import Connection, last_line, open_connection
from .engine import Outcome
from .errors import BuildError
from .inventory import Host
from .lock import held_lock
from .state import read_state, update_state

Say = Callable[[str], None]

# Minimum nvcc per arch (the design's facts; archs not listed rely on `nvcc --list-gpu-arch`).
MIN_NVCC: dict[tuple[int, int], tuple[int, int]] = {
    (9, 0): (11, 8), (10, 0): (12, 8), (12, 0): (12, 8), (10, 3): (12, 9), (12, 1): (12, 9), (11, 0): (13, 0)}
# The kernel-build concern's sources (tests excluded): what a rebuild depends on.
SOURCE_FIND_ARGS = ["python/sglang/kernels/jit", "-type", "f", "-name", "ddtree*"]
SOURCE_FILES = ["python/sglang/srt/speculative/ddtree_kernel.py", "python/sglang/srt/speculative/ddtree_build.py"]
DEFAULT_CACHE_ROOT = "$HOME/.cache/ddeploy/jit"
CACHE_ROOT_ENV = "DDEPLOY_JIT_CACHE_ROOT"  # inventory `env:` key overriding the host's JIT cache root
PREBUILD_MODULE = "sglang.srt.speculative.ddtree_build"


@dataclass(frozen=True)
class Toolkit:
    cuda_home: str
    version: tuple[int, int]
    archs: frozenset[str] | None  # compute_XXX from `nvcc --list-gpu-arch`, None when it has none

    @property
    def version_text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


@dataclass
class BuildPlan:
    host: str
    arch: str  # sm_120
    capability: tuple[int, int]
    toolkit: Toolkit
    source_hash: str
    cache_dir: str
    version: str  # the applied patch set
    action: str = "build"  # build | noop
    reason: str = ""
    gpu: str | None = None  # nvidia-smi's name, when the host has one
    previous_cache_dir: str | None = None  # the arch's current build before this one

    @property
    def key(self) -> str:
        return f"{self.source_hash}|{self.arch}|{self.toolkit.version_text}"


@dataclass(frozen=True)
class BuildOptions:
    force: bool = False
    accept_new_host_keys: bool = False


# --- facts -------------------------------------------------------------------------------------

def parse_nvidia_smi(text: str) -> list[tuple[str, tuple[int, int]]]:
    """`name, compute_cap` CSV lines (noheader) -> [(name, (major, minor))]."""
    gpus = []
    for line in text.strip().splitlines():
        name, _, cap = line.rpartition(",")
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", cap)
        if not name.strip() or not m:
            raise BuildError(f"cannot read nvidia-smi output line {line!r} (expected 'name, compute_cap')")
        gpus.append((name.strip(), (int(m.group(1)), int(m.group(2)))))
    return gpus


def probe_gpus(conn: Connection) -> list[tuple[str, tuple[int, int]]] | None:
    """The host's GPUs from nvidia-smi, or None where the host has no nvidia-smi."""
    res = conn.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"], check=False)
    if res.rc == 127:  # the shell (or env) found no nvidia-smi
        return None
    if res.rc != 0:
        raise BuildError(f"nvidia-smi failed (exit {res.rc}): {last_line(res.stderr)}", host=conn.name)
    return parse_nvidia_smi(res.stdout)


def check_gpus_match(host: Host, gpus: list[tuple[str, tuple[int, int]]] | None) -> str | None:
    if not gpus:
        return None
    want = host.gpu.capability
    for name, cap in gpus:
        if cap != want:
            raise BuildError(f"inventory says gpu.arch {host.gpu.arch} ({host.gpu.model}) in {host.source}, but "
                             f"nvidia-smi reports {name}, compute capability {cap[0]}.{cap[1]} (sm_{cap[0]}{cap[1]}); "
                             f"fix gpu.arch in the inventory", host=host.name)
    return gpus[0][0]


_FIND_CUDA = r'''
if [ -n "$1" ]; then printf '%s' "$1"; exit 0; fi
if [ -x /usr/local/cuda/bin/nvcc ]; then printf /usr/local/cuda; exit 0; fi
p=$(command -v nvcc) || exit 3
p=$(readlink -f "$p"); d=$(dirname "$p")
# A wrapper script (exec /path/bin/nvcc "$@") names the real toolkit.
real=$(sed -n 's|^exec \(/[^ ]*/bin/nvcc\) .*|\1|p' "$p" 2>/dev/null | head -n1)
[ -n "$real" ] && d=$(dirname "$real")
printf '%s' "$(dirname "$d")"
'''


def resolve_cuda_home(conn: Connection, host: Host) -> str:
    res = conn.run(["sh", "-c", _FIND_CUDA, "sh", host.env.get("CUDA_HOME", "")], check=False)
    if res.rc != 0 or not res.stdout.strip():
        raise BuildError(f"no CUDA toolkit found (no CUDA_HOME in {host.source}, no /usr/local/cuda, no nvcc on "
                         f"PATH); install CUDA >= 12.8 or set env.CUDA_HOME", host=host.name)
    return res.stdout.strip()


def parse_nvcc_version(text: str) -> tuple[int, int] | None:
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def probe_toolkit(conn: Connection, host: Host, cuda_home: str) -> Toolkit:
    nvcc = f"{cuda_home.rstrip('/')}/bin/nvcc"
    res = conn.run([nvcc, "--version"], check=False)
    if res.rc != 0:
        where = f"CUDA_HOME={cuda_home}" + (f" from {host.source}" if "CUDA_HOME" in host.env else "")
        raise BuildError(f"no working nvcc at {nvcc} ({where}; exit {res.rc}); install the CUDA toolkit "
                         f"(>= 12.8 for Blackwell) or point env.CUDA_HOME at one", host=host.name)
    version = parse_nvcc_version(res.stdout)
    if version is None:
        raise BuildError(f"cannot read the version from `{nvcc} --version`: {res.stdout.strip()[-200:]!r}",
                         host=host.name)
    listed = conn.run([nvcc, "--list-gpu-arch"], check=False)
    archs = frozenset(re.findall(r"compute_\d+[af]?", listed.stdout)) if listed.rc == 0 else None
    return Toolkit(cuda_home, version, archs or None)


def check_toolkit_supports(host: Host, toolkit: Toolkit) -> None:
    major, minor = host.gpu.capability
    arch = f"sm_{major}{minor}"
    need = MIN_NVCC.get((major, minor))
    nvcc = f"{toolkit.cuda_home}/bin/nvcc"
    if need and toolkit.version < need:
        raise BuildError(f"{arch} needs nvcc >= {need[0]}.{need[1]}, but {nvcc} is {toolkit.version_text}; "
                         f"install a newer CUDA toolkit on the host or point env.CUDA_HOME at one", host=host.name)
    if toolkit.archs is not None and f"compute_{major}{minor}" not in toolkit.archs:
        listed = " ".join(sorted(toolkit.archs, key=lambda a: int(re.sub(r"\D", "", a))))
        raise BuildError(f"nvcc {toolkit.version_text} at {nvcc} cannot build {arch} (its --list-gpu-arch: "
                         f"{listed}); use a toolkit that supports {arch}", host=host.name)


def probe_source_hash(conn: Connection, host: Host) -> str:
    """sha256 over `sha256sum` lines of the kernel sources (sorted paths, relative to the checkout)."""
    script = ('cd "$1" && shift && { find "$@"; for f in ' + " ".join(shlex.quote(f) for f in SOURCE_FILES) +
              '; do [ -f "$f" ] && echo "$f"; done; } | LC_ALL=C sort | xargs -r sha256sum')
    res = conn.run(["sh", "-c", script, "sh", host.checkout, *SOURCE_FIND_ARGS], check=False)
    if res.rc != 0 or not res.stdout.strip():
        raise BuildError(f"no DDTree kernel sources under {host.checkout}/python/sglang/kernels/jit; is the "
                         f"patch set applied?", host=host.name)
    return hashlib.sha256(res.stdout.encode()).hexdigest()


_EXPAND_HOME = r'''r=$1
case $r in
  "~"|"~/"*) r="$HOME${r#"~"}" ;;
  '$HOME'|'$HOME/'*) r="$HOME${r#'$HOME'}" ;;
esac
printf '%s' "$r"
'''


def resolve_cache_root(conn: Connection, host: Host) -> str:
    """The host's JIT cache root; a leading ~ or $HOME is expanded on the host (nothing else is)."""
    root = host.env.get(CACHE_ROOT_ENV) or DEFAULT_CACHE_ROOT
    return conn.run(["sh", "-c", _EXPAND_HOME, "sh", root]).stdout.strip().rstrip("/")


def check_python_imports_checkout(conn: Connection, host: Host) -> None:
    """The host python must import sglang from this checkout (an editable install), not elsewhere."""
    code = ("import importlib.util as u; s = u.find_spec('sglang'); "
            "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')")
    res = conn.run([host.python, "-c", code], cwd="/", check=False)
    want = f"{host.checkout.rstrip('/')}/python/sglang"
    got = res.stdout.strip()
    if res.rc != 0:
        raise BuildError(f"cannot run the host python {host.python} (from {host.source}): "
                         f"{last_line(res.stderr, default=f'exit {res.rc}')}", host=host.name)
    if not got:
        raise BuildError(f"{host.python} cannot import sglang; install the checkout into it "
                         f"(pip install -e {host.checkout}/python)", host=host.name)
    real = conn.run(["sh", "-c", 'readlink -f "$1"; readlink -f "$2"', "sh", got, want]).stdout.split()
    if len(real) == 2 and real[0] != real[1]:
        raise BuildError(f"{host.python} imports sglang from {got}, not from the checkout {want}; install the "
                         f"checkout editable (pip install -e {host.checkout}/python)", host=host.name)


# --- plan --------------------------------------------------------------------------------------

def cache_has_build(conn: Connection, cache_dir: str, capability: tuple[int, int]) -> bool:
    pattern = f"sm{capability[0]}{capability[1]}*/sgl_kernel_jit_speculative_ddtree/build-*/deps-*/*.so"
    res = conn.run(["sh", "-c", 'cd "$1" 2>/dev/null && for f in $2; do [ -f "$f" ] && exit 0; done; exit 1',
                    "sh", cache_dir, pattern], check=False)
    return res.rc == 0


def plan_build(conn: Connection, host: Host, opts: BuildOptions) -> BuildPlan:
    state = read_state(conn, host)
    applied = state.get("applied")
    if not applied:
        raise BuildError(f"no patch set is applied to {host.checkout}; push one first "
                         f"(ddeploy push --host {host.name})", host=host.name)
    check_python_imports_checkout(conn, host)
    gpu = check_gpus_match(host, probe_gpus(conn))
    toolkit = probe_toolkit(conn, host, resolve_cuda_home(conn, host))
    check_toolkit_supports(host, toolkit)
    source_hash = probe_source_hash(conn, host)
    cache_dir = f"{resolve_cache_root(conn, host)}/{source_hash[:16]}"
    major, minor = host.gpu.capability
    plan = BuildPlan(host.name, f"sm_{major}{minor}", (major, minor), toolkit, source_hash, cache_dir,
                     applied.get("version", "?"), gpu=gpu)
    current = (state.get("builds") or {}).get(plan.arch) or {}
    known = current.get("known") or {}
    plan.previous_cache_dir = current.get("cache_dir")
    if opts.force:
        plan.reason = "--force"
    elif plan.key not in known:
        plan.reason = "no build for these kernel sources, arch and nvcc yet"
    elif not cache_has_build(conn, cache_dir, plan.capability):
        plan.reason = f"the recorded build is gone from {cache_dir}"
    else:
        plan.action = "noop"
        prior = known[plan.key]
        plan.reason = f"already built for these sources (version {prior.get('version', '?')}, {prior.get('at', '?')})"
    return plan


# --- execute -----------------------------------------------------------------------------------

def prebuild_argv(host: Host, plan: BuildPlan) -> list[str]:
    major, minor = plan.capability
    return [host.python, "-m", PREBUILD_MODULE, "--arch", f"{major}.{minor}", "--cache-dir", plan.cache_dir, "--json"]


def run_prebuild(conn: Connection, host: Host, plan: BuildPlan, say: Say) -> dict[str, Any]:
    """Run the prebuild on the host (stderr streamed), return its JSON summary."""
    # Bytecode goes into the checkout's .git so the work tree stays clean (no drift).
    res = conn.run(prebuild_argv(host, plan), cwd=host.checkout, check=False, stream=say,
                   env={"CUDA_HOME": plan.toolkit.cuda_home,
                        "PYTHONPYCACHEPREFIX": f"{host.checkout.rstrip('/')}/.git/ddeploy/pycache"})
    try:
        summary = json.loads(res.stdout)
    except json.JSONDecodeError:
        summary = None
    if res.rc != 0 or not isinstance(summary, dict):
        failed = [m for m in (summary or {}).get("modules", []) if m.get("status") == "failed"]
        detail = (f"{failed[0]['module']}: {failed[0].get('reason', '')[-300:]}" if failed else
                  last_line(res.stderr))
        raise BuildError(f"kernel build for {plan.arch} failed (exit {res.rc}): {detail}", host=host.name)
    return summary


def record_build(conn: Connection, host: Host, plan: BuildPlan, summary: dict[str, Any] | None, ok: bool) -> None:
    """builds[arch] = this build (ok or not) plus `known`: every good build by cache key."""
    builds = dict(read_state(conn, host).get("builds") or {})
    known = dict((builds.get(plan.arch) or {}).get("known") or {})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {"ok": ok, "nvcc": plan.toolkit.version_text, "cuda_home": plan.toolkit.cuda_home,
              "source_hash": plan.source_hash, "cache_dir": plan.cache_dir, "version": plan.version, "at": now,
              "modules": [{k: m.get(k) for k in ("module", "status", "seconds", "path", "reason")}
                          for m in (summary or {}).get("modules", [])]}
    if ok:
        known[plan.key] = {k: v for k, v in record.items() if k != "ok"}
    builds[plan.arch] = {**record, "known": known}
    update_state(conn, host, "builds", builds, message=f"build {plan.arch} {plan.source_hash[:12]}")


def record_reuse(conn: Connection, host: Host, plan: BuildPlan) -> None:
    """A no-op build of sources built before (e.g. after a rollback): make that build current again."""
    builds = dict(read_state(conn, host).get("builds") or {})
    entry = builds.get(plan.arch) or {}
    if entry.get("ok") and (entry.get("source_hash"), entry.get("version")) == (plan.source_hash, plan.version):
        return
    known = entry.get("known") or {}
    # `version` is the applied set this build now serves (launch scripts look it up by version).
    builds[plan.arch] = {**known[plan.key], "ok": True, "version": plan.version, "known": known}
    update_state(conn, host, "builds", builds, message=f"build {plan.arch} {plan.source_hash[:12]} (cached)")


# Modules that do not include the overlay's kernel sources; their cache leaves are immutable and
# self-verifying, so a new source hash's directory may start from the previous one's.
_SEED = r'''src=$1; dst=$2; pattern=$3
cd "$src" 2>/dev/null || exit 0
for d in $pattern; do
  case $d in */sgl_kernel_jit_speculative_ddtree) continue ;; esac
  [ -d "$d" ] && [ ! -e "$dst/$d" ] || continue
  mkdir -p "$dst/${d%/*}" && cp -al "$d" "$dst/$d"
done
'''


def drop_arch_cache(conn: Connection, plan: BuildPlan) -> None:
    """--force: remove this source hash's builds for this arch (SGLang keeps an existing leaf even
    when told to recompile, so a real rebuild starts from an empty directory)."""
    major, minor = plan.capability
    conn.run(["sh", "-c", 'cd "$1" 2>/dev/null || exit 0; for d in $2; do [ -d "$d" ] && rm -rf -- "$d"; done; exit 0',
              "sh", plan.cache_dir, f"sm{major}{minor}*"])


def seed_cache(conn: Connection, plan: BuildPlan, previous: str | None) -> None:
    """Hard-link SGLang's own modules (speculative_tree, ...) from the previous build's directory."""
    if previous and previous != plan.cache_dir:
        major, minor = plan.capability
        conn.run(["sh", "-c", _SEED, "sh", previous, plan.cache_dir, f"sm{major}{minor}*/sgl_kernel_jit_*"],
                 check=False)


def serve_hint(plan: BuildPlan) -> str:
    return (f"serve with the prebuilt kernels: SGLANG_JIT_CACHE_DIR={plan.cache_dir} SGLANG_CRASH_ON_JIT_COMPILE=1 "
            f"python -m sglang.launch_server ...")


def describe_modules(summary: dict[str, Any]) -> str:
    return ", ".join(f"{m['module']} {m['status']}" for m in summary.get("modules", []))


def build_host(host: Host, opts: BuildOptions, say: Say, *, reuse_only: bool = False) -> Outcome:
    """Plan and (unless it is a no-op) run the kernel build on one host; records it in the state.
    reuse_only: never compile; only re-record an existing build of these sources as current."""
    with open_connection(host, accept_new_host_keys=opts.accept_new_host_keys) as conn:
        plan = plan_build(conn, host, opts)
        if reuse_only and plan.action != "noop":
            return Outcome(f"no build ({plan.arch}: {plan.reason})", {})
        say(f"arch {plan.arch}" + (f" ({plan.gpu}, checked with nvidia-smi)" if plan.gpu else " (from the inventory)")
            + f", nvcc {plan.toolkit.version_text} at {plan.toolkit.cuda_home}, sources {plan.source_hash[:12]}")
        data = {"plan": {**asdict(plan), "toolkit": {"cuda_home": plan.toolkit.cuda_home,
                                                     "nvcc": plan.toolkit.version_text}}}
        if plan.action == "noop":
            record_reuse(conn, host, plan)
            say(f"nothing to build: {plan.reason}")
            say(serve_hint(plan))
            return Outcome(f"up to date ({plan.arch}, {plan.reason})", data)
        say(f"building ({plan.reason}) into {plan.cache_dir}")
        with held_lock(conn, host, f"ddeploy build {plan.arch}"):
            if opts.force:
                drop_arch_cache(conn, plan)
            else:
                seed_cache(conn, plan, plan.previous_cache_dir)
            try:
                summary = run_prebuild(conn, host, plan, say)
            except BuildError:
                record_build(conn, host, plan, None, ok=False)
                raise
            record_build(conn, host, plan, summary, ok=True)
    say(serve_hint(plan))
    data["build"] = summary
    return Outcome(f"built {plan.arch} with nvcc {plan.toolkit.version_text}: {describe_modules(summary)}",
                   data, changed=True)


# --- push --build ------------------------------------------------------------------------------

def kernel_sources_hash(host: Host, opts: BuildOptions) -> str | None:
    """The checkout's kernel-source hash now, or None when it has no kernel sources."""
    with open_connection(host, accept_new_host_keys=opts.accept_new_host_keys) as conn:
        try:
            return probe_source_hash(conn, host)
        except BuildError:
            return None


def push_then_build(host: Host, push: Callable[[Host, Say], Outcome], opts: BuildOptions, say: Say) -> Outcome:
    """`push --build`: push, then build only when the push changed the kernel sources."""
    before = kernel_sources_hash(host, opts)
    pushed = push(host, say)
    if not pushed.changed:
        return pushed
    after = kernel_sources_hash(host, opts)
    if after is None or after == before:
        say("kernel sources unchanged by this push; no build")
        if after is not None:  # the existing build (if any) now serves the new version too
            try:
                build_host(host, opts, lambda line: None, reuse_only=True)
            except BuildError as exc:  # the push itself succeeded; the next `ddeploy build` says more
                say(f"note: no usable kernel build for this version yet ({exc})")
        return Outcome(f"{pushed.summary}; kernel sources unchanged, no build", pushed.data, changed=True)
    built = build_host(host, opts, say)
    return Outcome(f"{pushed.summary}; {built.summary}", {**pushed.data, "build": built.data}, changed=True)
