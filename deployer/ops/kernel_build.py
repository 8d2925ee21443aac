"""`ddeploy build`: compile the DDTree JIT kernels in place on a host, for the host's GPU arch.

The agent does it all on the host in one call (deployer/agent/build.py, its plan build_plan.py): facts
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

from ..inventory import Host
from ..patchset import PatchSet
from ..transport.agent_client import AgentSession, agent_session
from ..transport.protocol import PushReply, Record, Reply
from ..transport.protocol_build import BuildReply, Target
from .deploy import Options, ensure_local_checkout, push_with, session
from .outcome import Outcome, Say

CACHE_ROOT_ENV = "DDEPLOY_JIT_CACHE_ROOT"  # inventory `env:` key overriding the host's JIT cache root


@dataclass(frozen=True)
class BuildOptions:
    force: bool = False
    accept_new_host_keys: bool = False
    command: str = "ddeploy build"


class PushBuildReply(Reply):
    """The agent's `push-build` reply (the push, the build it triggered or the note on reusing one)."""

    push: PushReply
    build: BuildReply | None = None
    kernel_sources_changed: bool = False
    note: str | None = None


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


def push_then_build(
    host: Host, ps: PatchSet, popts: Options, bopts: BuildOptions, say: Say, *, timeout: float | None = None
) -> Outcome:
    """`push --build` as one agent call (`push-build`): the push, then the build when it changed the
    kernel sources, under one hold of the checkout's lock (no other push can come in between).
    `timeout`: seconds for both (None: no limit but the connection's)."""
    ensure_local_checkout(host, say)
    build = {"target": target(host), "options": {"force": bopts.force, "reuse_only": False}}
    with session(host, popts) as agent:
        extra = {"build": build}
        res = push_with(agent, ps, popts, say, op="push-build", extra=extra, model=PushBuildReply, timeout=timeout)
    done = PushBuild(push=res.push, build=res.build, kernel_sources_changed=res.kernel_sources_changed, note=res.note)
    return Outcome(done, changed=res.push.changed)
