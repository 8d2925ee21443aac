"""`ddeploy build`: compile the DDTree JIT kernels in place on a host, for the host's GPU arch.

The agent does it all on the host in one call (deployer/agent/build.py): facts
(the applied set, the host python importing sglang from the checkout, nvidia-smi against the
inventory's gpu.arch, CUDA_HOME / nvcc version / --list-gpu-arch, the kernel-source hash), the
plan (cache key = source hash, arch, nvcc; one JIT cache directory per source hash under
DDEPLOY_JIT_CACHE_ROOT, default ~/.cache/ddeploy/jit on the host), then under the checkout's lock
the prebuild (`python -m sglang.srt.speculative.ddtree_build`, streamed as `[host] ...`) and the
record in the host's state (section "builds", per arch) for `ddeploy status` and `ddeploy launch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BuildError
from ..inventory import Host
from ..patchset import PatchSet
from ..transport.agent_client import AgentSession, agent_session
from ..transport.protocol import BuildReply, PushReply, Record, SourcesReply, Target
from .deploy import Options, ensure_local_checkout, push_with, session
from .outcome import Outcome, Say

CACHE_ROOT_ENV = "DDEPLOY_JIT_CACHE_ROOT"  # inventory `env:` key overriding the host's JIT cache root


@dataclass(frozen=True)
class BuildOptions:
    force: bool = False
    accept_new_host_keys: bool = False
    command: str = "ddeploy build"


class PushBuild(Record):
    """`push --build`: the push, and the build it triggered (None when the kernel sources did not change)."""

    push: PushReply
    build: BuildReply | None = None
    kernel_sources_changed: bool = False
    note: str | None = None


def target(host: Host) -> dict[str, Any]:
    """What the agent needs from the inventory to probe, plan and name its errors."""
    return Target(
        name=host.name,
        source=host.source,
        python=host.python,
        arch=host.gpu.arch,
        capability=host.gpu.capability,
        model=host.gpu.model,
        cuda_home=host.env.get("CUDA_HOME"),
        cache_root=host.env.get(CACHE_ROOT_ENV),
    ).to_data()


def build_with(agent: AgentSession, opts: BuildOptions, say: Say, *, reuse_only: bool = False) -> BuildReply:
    request = {"target": target(agent.host), "options": {"force": opts.force, "reuse_only": reuse_only}}
    return agent.call("build", request, BuildReply, stream=say)


def build_host(host: Host, opts: BuildOptions, say: Say) -> Outcome:
    """Plan and (unless it is a no-op) run the kernel build on one host; recorded in its state."""
    with agent_session(host, accept_new_host_keys=opts.accept_new_host_keys, command=opts.command) as agent:
        res = build_with(agent, opts, say)
    return Outcome(res, changed=res.changed)


def push_then_build(host: Host, ps: PatchSet, popts: Options, bopts: BuildOptions, say: Say) -> Outcome:
    """`push --build` over one connection: build only when the push changed the kernel sources."""
    ensure_local_checkout(host, say)
    with session(host, popts) as agent:  # its first call is `sources` (the early one, if opened ahead)
        before = agent.call("sources", {}, SourcesReply).source_hash
        pushed = push_with(agent, ps, popts, say)
        if not pushed.changed:
            return Outcome(PushBuild(push=pushed), changed=False)
        after = agent.call("sources", {}, SourcesReply).source_hash
        if after is not None and after != before:
            built = build_with(agent, bopts, say)
            return Outcome(PushBuild(push=pushed, build=built, kernel_sources_changed=True), changed=True)
        say("kernel sources unchanged by this push; no build")
        note = reuse_build(agent, bopts, say) if after is not None else None
    return Outcome(PushBuild(push=pushed, note=note), changed=True)


def reuse_build(agent: AgentSession, opts: BuildOptions, say: Say) -> str | None:
    """The existing build (if any) now serves the new version too; never compiles."""
    try:
        build_with(agent, opts, lambda line: None, reuse_only=True)
    except BuildError as exc:  # the push itself succeeded; the next `ddeploy build` says more
        note = f"no usable kernel build for this version yet ({exc})"
        say(f"note: {note}")
        return note
    return None
