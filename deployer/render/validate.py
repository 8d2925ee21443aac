"""Checks before rendering: each failure is one RenderError naming the value and what to do."""

from __future__ import annotations

from typing import Any

from ..errors import RenderError
from ..inventory import Host
from .ddtree_rules import check_ddtree, check_dispatch
from .profiles import HardwareProfile, Topology
from .tree_memory import gib, tree_memory

GIB = 1024**3 / 1e9  # GB per GiB
# Must be the same on every node of a multi-node deployment.
SHARED_KEYS = (
    "tp_size",
    "attn_dp_size",
    "ep_size",
    "nnodes",
    "replicas",
    "moe_a2a_backend",
    "deepep_mode",
    "enable_dp_lm_head",
    "model_path",
    "draft_model_path",
    "dflash_block_size",
    "tree_budget",
    "tree_topk",
    "dist_init_port",
    "attention_backend",
    "speculative_algorithm",
)
MODEL_ATTENTION = ("mla", "mha")
# What SGLang 0.5.23 itself refuses at argument resolution, in its own words (python/sglang/srt/).
SERVER_REFUSES = "SGLang 0.5.23 would refuse this launch"
DFLASH_DP_LM_HEAD = "DFLASH with dp attention requires --enable-dp-lm-head."
DFLASH_DP_LM_HEAD_SOURCE = "arg_groups/speculative_hook.py, _handle_dflash"
DP_DIVIDES_TP_ASSERT = "assert cfg.tp_size % cfg.attn_dp_size == 0"
DP_DIVIDES_TP_SOURCE = "arg_groups/parallel_hook.py, _handle_data_parallelism"
DRAFT_ATTENTION_BACKENDS = ("flashinfer", "fa3", "fa4", "triton", "trtllm_mha")  # SGLang 0.5.23 choices.py


def check_hosts(topology: Topology, hosts: list[Host], nnodes: int) -> None:
    names = ", ".join(h.name for h in hosts)
    if nnodes != len(hosts):
        raise RenderError(
            f"topology {topology.name} has nnodes {nnodes} but {len(hosts)} host(s) were given "
            f"({names}); pass one --host per node or a --group of {nnodes} hosts"
        )
    kinds = {(h.gpu.arch, h.gpu.count, h.interconnect) for h in hosts}
    if len(kinds) > 1:
        raise RenderError(
            f"hosts {names} differ in gpu.arch/gpu.count/interconnect ({sorted(kinds)}); "
            "a multi-node deployment needs identical hosts"
        )


def check_same_across_nodes(per_host: list[tuple[Host, dict[str, Any]]]) -> None:
    first_host, first = per_host[0]
    for host, values in per_host[1:]:
        for key in SHARED_KEYS:
            if values[key] != first[key]:
                raise RenderError(
                    f"{key} is {first[key]!r} on {first_host.name} but {values[key]!r} on {host.name}; "
                    "values shared by all nodes must agree (check the hosts' vars)"
                )


def _positive(values: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if values[key] < 1:
            raise RenderError(f"{key} must be at least 1 (got {values[key]})")


def check_gpu_counts(host: Host, topology: Topology, v: dict[str, Any]) -> None:
    _positive(v, "tp_size", "attn_dp_size", "ep_size", "nnodes", "replicas")
    tp, nnodes = v["tp_size"], v["nnodes"]
    if tp % nnodes:
        raise RenderError(f"tp_size {tp} does not divide over nnodes {nnodes}; tp_size counts the GPUs of all nodes")
    if tp % v["attn_dp_size"]:
        # 0.5.23's _handle_data_parallelism asserts it without a message: the server's log shows
        # the failed assert line and an empty AssertionError.
        raise RenderError(
            f'topology {topology.name}: {SERVER_REFUSES}: "{DP_DIVIDES_TP_ASSERT}" fails, an AssertionError '
            f"without a message ({DP_DIVIDES_TP_SOURCE}): attn_dp_size {v['attn_dp_size']} does not divide "
            f"tp_size {tp} (attention DP splits the TP group); pick an attn_dp_size that divides tp_size",
            host=host.name,
        )
    if v["ep_size"] not in (1, tp):
        raise RenderError(
            f"ep_size {v['ep_size']} must be 1 or equal tp_size {tp} (SGLang 0.5.23: ep_size x moe_dp_size == tp_size)"
        )
    per_node, replicas = tp // nnodes, v["replicas"]
    if per_node * replicas > host.gpu.count:
        raise RenderError(
            f"tp_size {tp} / nnodes {nnodes} x replicas {replicas} needs {per_node * replicas} "
            f"GPUs per node, but gpu.count is {host.gpu.count}",
            host=host.name,
        )
    if host.gpu.count % per_node:
        raise RenderError(
            f"tp_size {tp} / nnodes {nnodes} = {per_node} GPUs per node does not divide "
            f"gpu.count {host.gpu.count}; pick a tp_size whose per-node share divides it",
            host=host.name,
        )


def check_memory(host: Host, topology: Topology, v: dict[str, Any]) -> None:
    """Weights of one replica must fit in its GPUs' static memory fraction (KV cache needs the rest)."""
    if host.gpu.memory_gib is None:
        return
    need = v["model_weights_gb"] + v["draft_weights_gb"]
    gpus = v["tp_size"]
    usable = gpus * host.gpu.memory_gib * GIB * v["mem_fraction_static"]
    if need >= usable:
        raise RenderError(
            f"topology {topology.name} does not fit: one replica needs ~{need:.0f} GB of weights "
            f"(model_weights_gb {v['model_weights_gb']:g} + draft_weights_gb {v['draft_weights_gb']:g}) but gets "
            f"{gpus} x {host.gpu.memory_gib:g} GiB x mem_fraction_static {v['mem_fraction_static']:g} "
            f"= {usable:.0f} GB; "
            "use more GPUs per replica (e.g. tp8)",
            host=host.name,
        )


def check_backends(host: Host, topology: Topology, hw: HardwareProfile, v: dict[str, Any]) -> None:
    attn = v["attention_backend"]
    if attn in hw.unavailable_attention_backends:
        raise RenderError(
            f"attention_backend '{attn}' cannot run on {host.gpu.arch}: "
            f"{hw.unavailable_attention_backends[attn]}; pick another attention_backend (triton runs everywhere)",
            host=host.name,
        )
    if v["draft_attention_backend"] not in DRAFT_ATTENTION_BACKENDS:
        raise RenderError(
            f"draft_attention_backend '{v['draft_attention_backend']}' is not a DFLASH draft backend "
            f"(valid: {', '.join(DRAFT_ATTENTION_BACKENDS)})"
        )
    a2a = v["moe_a2a_backend"]
    if a2a in hw.unavailable_a2a_backends:
        raise RenderError(
            f"moe_a2a_backend '{a2a}' cannot run here: {hw.unavailable_a2a_backends[a2a]}; "
            "set moe_a2a_backend=none or pick an NVLink host",
            host=host.name,
        )
    if v["speculative_algorithm"] == "DFLASH" and v["attn_dp_size"] > 1 and not v["enable_dp_lm_head"]:
        raise RenderError(
            f'topology {topology.name}: {SERVER_REFUSES}: "{DFLASH_DP_LM_HEAD}" ({DFLASH_DP_LM_HEAD_SOURCE}): '
            f"attn_dp_size {v['attn_dp_size']} with enable_dp_lm_head false; set enable_dp_lm_head=true "
            "(or attn_dp_size=1)",
            host=host.name,
        )


def check_speculative(v: dict[str, Any]) -> None:
    if v["tree_budget"] < 0:
        raise RenderError(f"tree_budget must be 0 (DDTree off) or positive (got {v['tree_budget']})")
    if v["tree_budget"] > 0 and v["tree_topk"] < 1:
        raise RenderError(f"tree_topk must be at least 1 when tree_budget is set (got {v['tree_topk']})")
    _positive(v, "dflash_block_size")
    for key in ("accept_threshold_single", "accept_threshold_acc"):
        if not 0 < v[key] <= 1:
            raise RenderError(f"{key} must be in (0, 1] (got {v[key]}); 1.0 is lossless")


def check_ports(v: dict[str, Any]) -> None:
    for key in ("port", "dist_init_port"):
        if not 1 <= v[key] <= 65535:
            raise RenderError(f"{key} must be a TCP port in 1..65535 (got {v[key]})")


def check_host(host: Host, topology: Topology, hw: HardwareProfile, v: dict[str, Any]) -> None:
    check_ports(v)
    if topology.cpu_engine:
        check_cpu_engine(host, topology, v)
        return
    check_gpu_counts(host, topology, v)
    check_backends(host, topology, hw, v)
    check_speculative(v)
    check_model_attention(v)
    # What the DDTree server itself refuses: the overlay's rules, after the tool's own checks
    # (the verify's MoE dispatch first, in --set words).
    check_dispatch(host.name, topology.name, v)
    check_ddtree(host.name, topology.name, v)
    check_memory(host, topology, v)
    check_tree_memory(host, topology, v)


def check_cpu_engine(host: Host, topology: Topology, v: dict[str, Any]) -> None:
    """The CPU engine profile: only on hosts marked for it. The GPU checks (GPU counts, backends,
    memory) do not apply, nor do DDTree's released rules: the profile serves the harness's CPU copy,
    whose rules accept torch_native verify; that server judges its flags at start."""
    if not host.cpu_engine:
        raise RenderError(
            f"topology {topology.name} is the CPU engine profile (tiny models, the overlay's "
            "CPU stand-ins) of the local host and test hosts; it is never rendered for a GPU host "
            "(set cpu_engine: true only on a test host's inventory entry)",
            host=host.name,
        )
    for key, known in (("cpu_model_arch", ("mla", "llama")), ("cpu_model_kind", ("alternating", "random"))):
        if v[key] not in known:
            raise RenderError(f"{key} must be one of {', '.join(known)} (got {v[key]!r})")
    _positive(v, "tp_size", "replicas", "nnodes")
    if v["nnodes"] != 1 or v["replicas"] != 1 or v["attn_dp_size"] != 1 or v["ep_size"] != 1:
        raise RenderError(
            f"topology {topology.name} serves one CPU server: nnodes, replicas, attn_dp_size and ep_size must be 1"
        )
    check_speculative(v)


def check_tree_memory(host: Host, topology: Topology, v: dict[str, Any]) -> None:
    """DDTree's verify buffers must fit in the part of the headroom the tree may take."""
    m = tree_memory(v, host.gpu.memory_gib)
    if m is None or m.fits:
        return
    top = m.dominant
    raise RenderError(
        f"topology {topology.name}: DDTree's verify buffers need ~{gib(m.total)} {m.scope} "
        f"(the {top.name}, {gib(top.bytes)}, dominates) but may use {gib(m.budget)}, half of the "
        f"{gib(m.headroom)} SGLang leaves outside mem_fraction_static {v['mem_fraction_static']:g}; "
        f"lower {top.knob}, or mem_fraction_static",
        host=host.name,
    )


def check_model_attention(v: dict[str, Any]) -> None:
    if v["model_attention"] not in MODEL_ATTENTION:
        raise RenderError(
            f"model_attention must be one of {', '.join(MODEL_ATTENTION)} (got {v['model_attention']!r}): "
            "mla for Kimi K2.x / DeepSeek-V3 targets, mha otherwise"
        )
