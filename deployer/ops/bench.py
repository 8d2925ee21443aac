"""`ddeploy bench`: measure what a host serves with SGLang's own benchmark client, run there.

One connection, two agent calls. `wait` reads the serving launch (and waits until it serves); the
client renders the baseline if one is asked for (`compare`: linear DFlash or plain decoding: the
same topology with the same --set values plus the baseline's, `tree_budget=0` or no speculative
algorithm); `bench` then runs everything on the host, under the host's launch lock: the client
per concurrency and the greedy probes against the launch, and with a baseline: the launch
stopped, the baseline started, waited for, measured and stopped, and the launch started again
from its own scripts and waited for, whatever happened in between (a failed baseline, Ctrl-C, a
cut link: the host restores it without the client). The result is saved on the host (the
agent's state record, section `bench`; every result in `<launch_dir>/bench.jsonl`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import GreedyMismatchError, StateError, UsageError
from ..inventory import Host
from ..render import RenderedUnit, render_hosts
from ..transport.agent_client import AgentSession, agent_session
from ..transport.protocol import HostState, StateReply
from ..transport.protocol_serving import BenchReply, BenchRun, BenchSaveReply, LaunchRecord, Measurement, WaitReply
from . import bench_stats
from .launch import build_cache_dir, unit_request, wait_serving

Say = Callable[[str], None]

# What each baseline changes in the launch (render values over the recorded --set values).
BASELINES = {"linear": ("tree_budget=0",), "plain": ("speculative_algorithm=",)}
PROBE_PROMPTS = 8
PROBE_MAX_TOKENS = 64
PROBE_BUDGET_S = 600.0  # the greedy probes' share of the default deadline, per measured config


@dataclass(frozen=True)
class BenchParams:
    requests: int
    concurrency: tuple[int, ...]
    input_len: int
    output_len: int
    temperature: float
    seed: int = 1
    wait_timeout: float = 900.0
    run_timeout: float = 3600.0
    timeout: float | None = None  # the whole benchmark; None: deadline() from the other options
    # Client runs per config before the measured ones (discarded), and runs per concurrency. The
    # CLI's defaults are 1 and 3; these keep a caller that repeats on its own (rollout) as it was.
    warmup: int = 0
    repeats: int = 1

    def client_runs(self) -> int:
        """Client runs per measured config: the warm-up, then each concurrency `repeats` times."""
        return self.warmup + self.repeats * len(self.concurrency)

    def deadline(self, compare: str | None) -> float:
        """Seconds the whole benchmark may take on the host (its clients, probes and the baseline's
        start): every client run (warm-up and repeats) at its run timeout plus PROBE_BUDGET_S of
        probes per measured config, and the baseline's start at the wait timeout."""
        if self.timeout is not None:
            return self.timeout
        configs = 2 if compare else 1
        per_config = self.client_runs() * self.run_timeout + PROBE_BUDGET_S
        return configs * per_config + (self.wait_timeout if compare else 0.0)

    def check(self) -> None:
        sizes = {"requests": self.requests, "input-len": self.input_len, "output-len": self.output_len}
        sizes["repeats"] = self.repeats
        bad = [f"--{name} {value}" for name, value in sizes.items() if value < 1]
        bad += [f"--concurrency {c}" for c in self.concurrency if c < 1]
        if bad:
            raise UsageError(f"{', '.join(bad)}: must be at least 1")
        if self.warmup < 0:
            raise UsageError(f"--warmup {self.warmup}: must be 0 or more")
        if self.timeout is not None and self.timeout <= 0:
            raise UsageError(f"--timeout {self.timeout:g}: must be positive")
        if self.temperature < 0:
            raise UsageError(f"--temperature {self.temperature:g}: must be 0 (greedy) or positive")

    def data(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "concurrency": list(self.concurrency),
            "input_len": self.input_len,
            "output_len": self.output_len,
            "temperature": self.temperature,
            "seed": self.seed,
            "warmup": self.warmup,
            "repeats": self.repeats,
        }


def probe_prompts(vocab: int, seed: int, count: int = PROBE_PROMPTS) -> list[list[int]]:
    """Fixed token-id prompts (4 to 40 tokens, ids above the usual special tokens), the same for
    every configuration of a run."""
    rng = random.Random(seed)  # noqa: S311 - reproducible prompts, not a secret
    high = max(5, min(vocab, 32000))
    return [[rng.randrange(4, high) for _ in range(rng.randint(4, 40))] for _ in range(count)]


def first_difference(expected: list[list[int]], got: list[list[int]]) -> tuple[int, int] | None:
    """(prompt index, output position) of the first token that differs, None when all are equal."""
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        for j in range(max(len(want), len(have))):
            if j >= len(want) or j >= len(have) or want[j] != have[j]:
                return i, j
    return None


def _at(tokens: list[int], j: int) -> str:
    return str(tokens[j]) if j < len(tokens) else "end"


def by_concurrency(runs: list[BenchRun]) -> dict[int, list[dict[str, Any]]]:
    """The client's runs grouped by concurrency, in the order they ran."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        data = run.to_data()
        grouped.setdefault(data.pop("concurrency"), []).append(data)
    return grouped


def config_rows(reply: Measurement, baseline: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per concurrency of a measured config: the medians of its runs (and the runs), and
    with `baseline`'s runs the speedup over them."""
    probe_tokens = sum(p.completion_tokens or 0 for p in reply.probes or [])
    probe_verify = sum(p.verify_count or 0 for p in reply.probes or [])
    s = reply.serving
    rows = []
    for concurrency, runs in by_concurrency(reply.runs).items():
        base_tps = bench_stats.throughputs(baseline.get(concurrency, []))
        speed = bench_stats.speedup(bench_stats.throughputs(runs), base_tps) or {"ratio": None, "interval": None}
        rows.append(
            {
                "config": s.config,
                "script": reply.record.units[0].script_file,
                "verify_width": s.verify_width,
                "tree_budget": s.tree_budget,
                "tree_topk": s.tree_topk,
                "concurrency": concurrency,
                **bench_stats.median_row(runs),
                "speedup": speed["ratio"],
                "speedup_interval": speed["interval"],
                "probe_accept_length": probe_tokens / probe_verify if probe_verify else None,
                "probe_verify_count": probe_verify or None,
                "repeats": len(runs),
                "warmup_runs": reply.warmup,
                "runs": runs,
            }
        )
    return rows


class Bench:
    """One host's benchmark (and its baseline) over one agent session."""

    def __init__(self, agent: AgentSession, params: BenchParams, say: Say):
        self.agent, self.params, self.say = agent, params, say
        self.host: Host = agent.host

    # -- agent calls --------------------------------------------------------------------------

    def wait(self, base: str, started_here: bool = False) -> WaitReply:
        return wait_serving(self.agent, self.params.wait_timeout, self.say, base, started_here=started_here)

    def measure(
        self, base: str, record: LaunchRecord, probes: dict[str, Any] | None, compare: dict[str, Any] | None
    ) -> BenchReply:
        """The launch measured on the host, and with `compare` its baseline (the host restores the
        launch afterwards, with or without this client)."""
        deadline = self.params.deadline(compare and compare["variant"])
        request = {
            "target": {"name": self.host.name},
            "topology": record.topology,
            "base": base,
            "launch_id": record.id,
            "python": self.host.python,
            "params": self.params.data(),
            "probes": probes,
            "timeout": self.params.run_timeout,
            "wait_timeout": self.params.wait_timeout,
            "deadline": deadline,
            "compare": compare,
        }
        # The client's own bound: past the host's deadline, and the restore's wait, the call is cut
        # (the host then stops what runs and restores on its own).
        limit = deadline + self.params.wait_timeout + 120
        return self.agent.call("bench", request, BenchReply, stream=self.say, timeout=limit)

    @functools.cached_property
    def state(self) -> HostState:
        """The host's state record, read once per run (its applied version and kernel builds)."""
        return self.agent.call("state", {}, StateReply).state

    # -- the run ------------------------------------------------------------------------------

    def render(self, record: LaunchRecord, extra: tuple[str, ...]) -> list[RenderedUnit]:
        cache_dir, why = build_cache_dir(self.state, self.host.gpu.arch)
        probed = {self.host.name: ({"jit_cache_dir": cache_dir}, f"host {self.host.name} {why}")} if cache_dir else {}
        return render_hosts([self.host], record.topology, (*record.sets, *extra), probed=probed)

    def run(self, base: str, topology: str | None, compare: str | None, yes: bool) -> dict[str, Any]:
        served = self.wait(base)
        record = served.record
        if topology is not None and record.topology != topology:
            raise StateError(
                f"{self.host.name} serves topology {record.topology}, not {topology}; launch {topology} "
                f"first (`ddeploy stop --host {self.host.name}`, then `ddeploy launch --host {self.host.name} "
                f"--topology {topology} --wait`)",
                host=self.host.name,
            )
        if len(record.units) != 1:
            raise UsageError(
                f"bench drives one server; {record.topology} on {self.host.name} runs {len(record.units)} units "
                "(multi-node and multi-replica launches are not benchmarked by ddeploy yet)",
                host=self.host.name,
            )
        serving = served.serving[0]
        if compare and serving.config == compare:
            raise UsageError(
                f"{self.host.name} already serves {compare} ({record.topology}); --compare {compare} needs the "
                "DDTree launch serving",
                host=self.host.name,
            )
        if compare and not yes:
            raise UsageError(
                f"--compare restarts the server of {record.topology} running on {self.host.name} (it may be "
                "serving traffic); pass --yes to go ahead",
                host=self.host.name,
            )
        units = self.render(record, ())
        values = {v.key: v.value for v in units[0].values}
        greedy = self.params.temperature == 0 and compare is not None
        probes = None
        if greedy:
            prompts = probe_prompts(int(values["model_vocab_size"]), self.params.seed)
            probes = {"prompts": prompts, "output_len": min(self.params.output_len, PROBE_MAX_TOKENS)}
        baseline = None
        if compare:
            extra = BASELINES[compare]
            baseline_units = self.render(record, extra)
            baseline = {
                "variant": compare,
                "sets": [*record.sets, *extra],
                "units": [unit_request(u) for u in baseline_units],
            }
        then = f", then the {compare} baseline" if compare else ""
        self.say(f"measuring {serving.config} ({record.topology}){then}")
        reply = self.measure(base, record, probes, baseline)
        if reply.restored is not None:
            self.say(f"{record.topology} serves again (pid {', '.join(str(u.pid) for u in reply.restored.units)})")
        rows = [(m.record, m) for m in reply.measured]
        return self.result(base, rows, compare, probes)

    def result(self, base: str, rows, compare: str | None, probes) -> dict[str, Any]:
        state = self.state
        applied = state.applied
        first_record, first = rows[0]
        equal, difference = None, None
        if probes and len(rows) == 2:
            want = [p.output_ids for p in rows[1][1].probes or []]
            have = [p.output_ids for p in first.probes or []]
            spot = first_difference(want, have)
            equal = spot is None
            if spot is not None:
                i, j = spot
                difference = {
                    "prompt": i,
                    "prompt_ids": probes["prompts"][i],
                    "position": j,
                    "baseline": _at(want[i], j),
                    "got": _at(have[i], j),
                }
        base_runs = by_concurrency(rows[-1][1].runs) if len(rows) == 2 else {}
        configs = []
        for _, reply in rows:
            compared = base_runs if reply is first else {}
            configs += [{**row, "greedy_equal": equal} for row in config_rows(reply, compared)]
        build = state.builds.get(self.host.gpu.arch)
        return {
            "host": self.host.name,
            "topology": first_record.topology,
            "at": None,  # filled by save
            "applied": f"{applied.name} {applied.version}" if applied else None,
            "kernels": build.cache_dir if build and build.ok else None,
            "compare": compare,
            "params": self.params.data(),
            "serving": [reply.serving.to_data() for _, reply in rows],
            "configs": configs,
            "greedy": {
                "checked": equal is not None,
                "equal": equal,
                "prompts": len(probes["prompts"]) if probes else 0,
                "difference": difference,
            },
            "server_args": {reply.serving.config: reply.server_args for _, reply in rows},
            "launch_dir": base,
        }

    def save(self, result: dict[str, Any]) -> str:
        from ..agent.common import now

        result["at"] = now()
        request = {"base": result["launch_dir"], "result": result}
        return self.agent.call("bench-save", request, BenchSaveReply).history


def bench(
    host: Host,
    base: str,
    params: BenchParams,
    say: Say,
    *,
    topology: str | None = None,
    compare: str | None = None,
    yes: bool = False,
    command: str = "ddeploy bench",
) -> dict[str, Any]:
    """Measure the host's serving launch (and a baseline); the saved result. A greedy mismatch is
    saved first, then raised."""
    params.check()
    with agent_session(host, command=command) as agent:
        runner = Bench(agent, params, say)
        result = runner.run(base, topology, compare, yes)
        runner.save(result)
    diff = result["greedy"]["difference"]
    if diff is not None:
        raise GreedyMismatchError(
            f"greedy check failed: {result['configs'][0]['config']}'s completion of probe prompt {diff['prompt']} "
            f"({len(diff['prompt_ids'])} tokens, first {diff['prompt_ids'][:6]}) differs from {compare}'s at output "
            f"token {diff['position']} ({diff['got']} vs {diff['baseline']}); result saved, see `ddeploy status "
            f"--host {host.name} --json`",
            host=host.name,
            data=result,
        )
    return result
