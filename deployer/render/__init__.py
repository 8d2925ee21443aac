"""Launch scripts per host and topology, rendered from the Jinja2 templates under templates/.

`render_plan()` resolves and validates every value, then renders one script + env file per
unit: one per node of a multi-node topology, one per replica of a multi-replica one.
Nothing here needs SSH or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RenderError
from ..inventory import Host, Inventory
from . import validate
from .ddtree_rules import dispatch_env
from .jinja import ENV_TEMPLATE, SCRIPT_TEMPLATE, environment, render_template
from .profiles import HardwareProfile, Profiles, Topology, load_profiles
from .tree_memory import TreeMemory, gib, tree_memory
from .values import Value, host_facts, parse_sets, plain, resolve

__all__ = [
    "RenderedUnit",
    "render_plan",
    "render_hosts",
    "render_all",
    "write_units",
    "explain_rows",
    "memory_rows",
    "memory_heading",
    "load_profiles",
    "parse_sets",
    "Value",
    "launch_dir_for",
]


@dataclass(frozen=True)
class RenderedUnit:
    """One launch script (and its env file) for one host, node rank and replica."""

    host: str
    topology: str
    node_rank: int
    replica: int
    name: str
    script: str
    env: str
    values: tuple[Value, ...]
    memory: TreeMemory | None = None  # DDTree's verify buffers per GPU / DP rank (None: off or no GPU size)

    @property
    def script_file(self) -> str:
        return f"{self.name}.sh"

    @property
    def env_file(self) -> str:
        return f"{self.name}.env"


def _unit_name(host: Host, topology: str, replica: int, replicas: int) -> str:
    return f"{host.name}-{topology}" + (f"-r{replica}" if replicas > 1 else "")


def _layout(
    host: Host, topo: Topology, v: dict[str, Any], node_rank: int, replica: int, init_addr: str
) -> dict[str, Value]:
    """Per-unit values computed from the resolved ones (not settable)."""
    per_node = v["tp_size"] // v["nnodes"]
    name = _unit_name(host, topo.name, replica, v["replicas"])
    gpus = range(replica * per_node, (replica + 1) * per_node)
    computed = {
        "topology": topo.name,
        "cpu_engine": topo.cpu_engine,
        "node_rank": node_rank,
        "replica": replica,
        "unit_port": v["port"] + replica,
        # The CPU engine sees no GPU; each of its TP ranks gets one core instead.
        "cuda_visible_devices": "" if topo.cpu_engine else ",".join(str(i) for i in gpus),
        "cpu_threads_bind": "|".join(str(i) for i in gpus) if topo.cpu_engine else "",
        "dist_init_addr": init_addr,
        "script_file": f"{name}.sh",
        "env_file": f"{name}.env",
    }
    return {k: Value(k, val, "layout (computed)") for k, val in computed.items()}


def _resolve_hosts(
    profiles: Profiles,
    hosts: list[Host],
    topology: str,
    sets: list[str] | tuple[str, ...],
    probed: dict[str, tuple[dict[str, Any], str]],
):
    topo = profiles.topology(topology)
    pairs = parse_sets(sets)
    per_host = []
    for host in hosts:
        hw = profiles.hardware_for(host)
        values = resolve(profiles, host, topo, hw, pairs, probed.get(host.name))
        if not topo.cpu_engine:
            values.update(dispatch_env(plain(values)))
        per_host.append((host, hw, values))
    return topo, per_host


def render_plan(
    hosts: list[Host],
    topology: str,
    sets: list[str] | tuple[str, ...] = (),
    profiles: Profiles | None = None,
    probed: dict[str, tuple[dict[str, Any], str]] | None = None,
) -> list[RenderedUnit]:
    """Validate, then render every unit of `topology` over `hosts` (node rank = position in the list).
    `probed`: per host name, (values, source) read from the host (launch passes its build record)."""
    profiles = profiles or load_profiles()
    if not hosts:
        raise RenderError("no host given: pass --host NAME (or --group NAME for a multi-node topology)")
    topo, per_host = _resolve_hosts(profiles, hosts, topology, sets, probed or {})
    _validate(topo, per_host)
    return _render_units(profiles, topo, per_host)


def _validate(topo: Topology, per_host: list[tuple[Host, HardwareProfile, dict[str, Value]]]) -> None:
    flat = [(host, plain(values)) for host, _, values in per_host]
    validate.check_hosts(topo, [h for h, _ in flat], flat[0][1]["nnodes"])
    validate.check_same_across_nodes(flat)
    for (host, hw, _), (_, v) in zip(per_host, flat, strict=True):
        validate.check_host(host, topo, hw, v)


def _render_units(
    profiles: Profiles, topo: Topology, per_host: list[tuple[Host, HardwareProfile, dict[str, Value]]]
) -> list[RenderedUnit]:
    """One unit per (node, replica); every node points at rank 0's init address."""
    rank0 = plain(per_host[0][2])
    init_addr = f"{rank0['node_addr']}:{rank0['dist_init_port']}"
    env = environment(profiles.directory)
    units = []
    for rank, (host, _, values) in enumerate(per_host):
        v = plain(values)
        for replica in range(v["replicas"]):
            all_values = {**values, **_layout(host, topo, v, rank, replica, init_addr)}
            ctx = plain(all_values)
            units.append(
                RenderedUnit(
                    host.name,
                    topo.name,
                    rank,
                    replica,
                    ctx["script_file"][:-3],
                    render_template(env, SCRIPT_TEMPLATE, ctx),
                    render_template(env, ENV_TEMPLATE, ctx),
                    tuple(all_values[k] for k in sorted(all_values)),
                    None if topo.cpu_engine else tree_memory(v, host.gpu.memory_gib),
                )
            )
    return units


def render_hosts(
    hosts: list[Host],
    topology: str,
    sets: list[str] | tuple[str, ...] = (),
    profiles: Profiles | None = None,
    probed: dict[str, tuple[dict[str, Any], str]] | None = None,
) -> list[RenderedUnit]:
    """Like render_plan, but a single-node topology over several hosts renders each host on its own."""
    profiles = profiles or load_profiles()
    topo = profiles.topology(topology)
    nnodes = dict(parse_sets(sets)).get("nnodes", topo.values.get("nnodes", profiles.defaults["nnodes"]))
    if str(nnodes).strip() == "1" and len(hosts) > 1:
        return [u for h in hosts for u in render_plan([h], topology, sets, profiles, probed)]
    return render_plan(hosts, topology, sets, profiles, probed)


def launch_dir_for(host: Host, sets: list[str] | tuple[str, ...] = ()) -> str:
    """Where launch scripts, logs and the launch record live on the host (no topology needed)."""
    pairs = dict(parse_sets(sets))
    return str(pairs.get("launch_dir") or host.vars.get("launch_dir") or host_facts(host)["launch_dir"])


def memory_rows(units: list[RenderedUnit]) -> list[list[str]]:
    """unit, term, estimate per GPU (attention DP: per DP rank, one GPU), share of SGLang's
    headroom (what `--explain` adds)."""
    rows = []
    for unit in (u for u in units if u.memory is not None):
        m = unit.memory
        for term in m.terms:
            rows.append([unit.name, term.name, gib(term.bytes), f"{term.bytes / m.headroom:.0%}"])
        if m.per_dp_rank:
            total = (
                f"total per DP rank (W = {m.width}, {m.requests} requests = "
                f"{m.max_running_requests} / attn_dp_size {m.attn_dp_size})"
            )
        else:
            total = f"total (W = {m.width})"
        rows.append([unit.name, total, gib(m.total), f"{m.total / m.headroom:.0%}"])
        rows.append([unit.name, "headroom (1 - mem_fraction_static)", gib(m.headroom), "tree may use 50%"])
    return rows


def memory_heading(units: list[RenderedUnit]) -> str:
    """The --explain estimate's column title: per GPU (plain TP), per DP rank (attention DP)."""
    dp = {u.memory.per_dp_rank for u in units if u.memory is not None}
    scope = "per GPU or DP rank" if len(dp) > 1 else "per DP rank" if dp == {True} else "per GPU"
    return f"DDTree verify memory {scope}"


def explain_rows(units: list[RenderedUnit]) -> list[list[str]]:
    """unit, key, value, source for every value of every unit (what `--explain` prints)."""
    return [[u.name, v.key, _show(v.value), v.source] for u in units for v in u.values]


def _show(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(value) if value else "[]"
    if value is None or value == "":
        return "(unset)"
    return str(value).lower() if isinstance(value, bool) else str(value)


def render_all(
    inventory: Inventory,
    sets: list[str] | tuple[str, ...] = (),
    profiles: Profiles | None = None,
    multi_node_only: bool = False,
):
    """Every valid (host or group, topology) pair: (units, [(label, reason) skipped])."""
    profiles = profiles or load_profiles()
    hosts = [h for h in inventory.hosts.values() if not h.is_local]
    units: list[RenderedUnit] = []
    skipped: list[tuple[str, str]] = []
    for name, topo in profiles.topologies.items():
        nnodes = int(topo.values.get("nnodes", profiles.defaults["nnodes"]))
        if multi_node_only and nnodes == 1:
            continue
        candidates = [[h] for h in hosts] if nnodes == 1 else _groups_of(inventory, hosts, nnodes)
        if not candidates:
            skipped.append((name, f"no host group of {nnodes} hosts in the inventory"))
        for group in candidates:
            label = f"{'+'.join(h.name for h in group)} {name}"
            try:
                units.extend(render_plan(group, name, sets, profiles))
            except RenderError as exc:
                skipped.append((label, str(exc)))
    return units, skipped


def _groups_of(inventory: Inventory, hosts: list[Host], size: int) -> list[list[Host]]:
    names = {h.name for h in hosts}
    return [
        [inventory.get(n) for n in members]
        for _, members in sorted(inventory.groups.items())
        if len(members) == size and set(members) <= names
    ]


def write_units(units: list[RenderedUnit], out_dir: Path) -> list[Path]:
    """Write each unit's script (mode 0755) and env file (0600 from its creation: it may hold
    tokens) into out_dir, with the writer the agent uses on hosts."""
    from ..agent.units import write_files

    files = [f for u in units for f in ((u.script_file, u.script, 0o755), (u.env_file, u.env, 0o600))]
    try:
        return [Path(p) for p in write_files(str(out_dir), files)]
    except OSError as exc:
        raise RenderError(
            f"cannot write launch scripts to {out_dir}: {exc.strerror or exc}; choose a writable -o directory"
        ) from None
