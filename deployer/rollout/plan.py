"""The rollout's plan: units (what a topology serves, rolled as one), the canary, the batches after
it, and the checks that refuse a plan before anything is touched.

A unit is one host, or the inventory group of hosts that one multi-node launch spans (its
topology's nnodes; `tp16-2node`, `ep16-2node`): its hosts are drained, changed, launched and
measured together, never half. `ep4`'s two replicas on one host are one launch, so one unit per
host. A host that serves nothing is a unit too: it is updated (push, build, tests) and not
launched or measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UsageError
from ..inventory import Host, Inventory
from .spec import RolloutSpec, step_value


@dataclass(frozen=True)
class Serving:
    """What a host's last launch serves now (its launch record)."""

    topology: str
    sets: tuple[str, ...] = ()
    nnodes: int = 1


@dataclass(frozen=True)
class Unit:
    hosts: tuple[Host, ...]
    serving: Serving | None
    versions: tuple[str | None, ...] = field(default=())  # per host, applied before the rollout

    @property
    def name(self) -> str:
        return "+".join(h.name for h in self.hosts)

    @property
    def version(self) -> str | None:
        return self.versions[0] if self.versions else None


@dataclass(frozen=True)
class Plan:
    version: str
    units: tuple[Unit, ...]
    batches: tuple[tuple[str, ...], ...]  # unit names; batches[0] is the canary
    max_failures: int
    min_available: int

    def unit(self, name: str) -> Unit:
        return next(u for u in self.units if u.name == name)

    def to_data(self) -> dict[str, object]:
        return {
            "version": self.version,
            "units": [
                {
                    "name": u.name,
                    "hosts": [h.name for h in u.hosts],
                    "versions": list(u.versions),
                    "serving": None
                    if u.serving is None
                    else {"topology": u.serving.topology, "sets": list(u.serving.sets), "nnodes": u.serving.nnodes},
                }
                for u in self.units
            ],
            "batches": [list(b) for b in self.batches],
            "max_failures": self.max_failures,
            "min_available": self.min_available,
        }


def make_units(
    hosts: list[Host], serving: dict[str, Serving | None], versions: dict[str, str | None], inventory: Inventory
) -> list[Unit]:
    """Units in the hosts' order: single hosts, and each multi-node launch's inventory group."""
    units: list[Unit] = []
    taken: set[str] = set()
    chosen = {h.name for h in hosts}
    for host in hosts:
        if host.name in taken:
            continue
        now = serving.get(host.name)
        if now is None or now.nnodes == 1:
            members = [host]
        else:
            members = _group_of(host, now, serving, inventory, chosen)
        taken.update(h.name for h in members)
        units.append(Unit(tuple(members), now, tuple(versions.get(h.name) for h in members)))
    return units


def _group_of(
    host: Host, now: Serving, serving: dict[str, Serving | None], inventory: Inventory, chosen: set[str]
) -> list[Host]:
    """The inventory group of `now.nnodes` hosts, all chosen and serving the same topology, that
    holds `host`: a multi-node launch rolls as one unit, never half."""
    for group, members in sorted(inventory.groups.items()):
        if host.name not in members or len(members) != now.nnodes:
            continue
        same = all(serving.get(m) is not None and serving[m].topology == now.topology for m in members)
        if not same:
            continue
        missing = [m for m in members if m not in chosen]
        if missing:
            raise UsageError(
                f"host {host.name} serves {now.topology} with group {group} ({', '.join(members)}); "
                f"a multi-node launch rolls as one unit: select {', '.join(missing)} too (or --group {group})"
            )
        return [inventory.get(m) for m in members]
    raise UsageError(
        f"host {host.name} serves {now.topology} ({now.nnodes} nodes) but no inventory group of "
        f"{now.nnodes} hosts serving it holds {host.name}; the rollout cannot tell which hosts form that launch"
    )


def batch_sizes(spec: RolloutSpec, total: int) -> list[int]:
    """Sizes after the canary, from the ramp (its last step repeats); a percentage is of all units,
    rounded up, at least one."""
    steps = []
    for item in spec.batch:
        n, percent = step_value(item)
        steps.append(max(1, math.ceil(total * n / 100)) if percent else n)
    left, sizes, i = total - 1, [], 0
    while left > 0:
        size = min(steps[min(i, len(steps) - 1)], left)
        sizes.append(size)
        left -= size
        i += 1
    return sizes


def make_plan(version: str, units: list[Unit], spec: RolloutSpec, canary: str | None = None) -> Plan:
    """Canary first (`canary`: the unit holding that host; default the first unit), then the ramp;
    refused when a batch would leave fewer than min_available units serving."""
    if not units:
        raise UsageError("no hosts to roll out to")
    order = list(units)
    if canary is not None:
        pick = next((u for u in order if canary in {h.name for h in u.hosts}), None)
        if pick is None:
            raise UsageError(f"--canary {canary}: not one of the selected hosts ({', '.join(u.name for u in order)})")
        order.remove(pick)
        order.insert(0, pick)
    batches: list[tuple[str, ...]] = [(order[0].name,)]
    at = 1
    for size in batch_sizes(spec, len(order)):
        batches.append(tuple(u.name for u in order[at : at + size]))
        at += size
    plan = Plan(version, tuple(order), tuple(batches), spec.max_failures(len(order)), spec.min_available)
    check_available(plan)
    return plan


def check_available(plan: Plan) -> None:
    serving = sum(1 for u in plan.units if u.serving is not None)
    for i, batch in enumerate(plan.batches):
        down = sum(1 for name in batch if plan.unit(name).serving is not None)
        if serving - down < plan.min_available:
            label = "the canary" if i == 0 else f"batch {i}"
            raise UsageError(
                f"{label} ({', '.join(batch)}) would leave {serving - down} of {serving} serving units up, "
                f"under --min-available {plan.min_available}; use smaller batches or a lower --min-available"
            )


def describe(plan: Plan, spec: RolloutSpec) -> str:
    """The plan as the operator reads it before anything runs."""
    from ..cli.output import table

    rows = []
    for i, batch in enumerate(plan.batches):
        for j, name in enumerate(batch):
            unit = plan.unit(name)
            step = ("canary" if i == 0 else f"batch {i}") if j == 0 else ""
            now = "nothing (update only)" if unit.serving is None else unit.serving.topology
            rows.append([step, name, unit.version or "none", now])
    g, m = spec.gates, spec.measure
    lines = [
        f"rollout of ddtree {plan.version} over {len(plan.units)} unit(s), canary first, in place",
        table(rows, ["step", "unit", "applied now", "serves"]),
        f"max fail {plan.max_failures}; min available {plan.min_available}; drain {spec.drain_timeout_s:g} s; "
        f"deadlines build {spec.deadlines.build_s:g} s, launch {spec.deadlines.launch_s:g} s, "
        f"gates {spec.deadlines.gates_s:g} s",
        f"gates per serving unit: /health_generate; greedy completions of {m.probes} prompts x "
        f"{m.probe_tokens} tokens equal the unit's before; accept length at most "
        f"{g.accept_length_drop_pct:g}% lower; output tokens/s at most {g.throughput_drop_pct:g}% lower and "
        f"ITL p99 at most {g.itl_p99_rise_pct:g}% higher ({m.repeats} runs each, inside the runs' spread: "
        f"inconclusive); no failed requests",
    ]
    return "\n".join(lines)
