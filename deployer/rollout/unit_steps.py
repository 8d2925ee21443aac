"""One unit's move to the new release, and its way back; each step one of ddeploy's own
operations (the same agent calls `push --build`, `test --remote`, `launch --wait`, `stop` and
`bench` make).

    steps = UnitSteps(unit, patch_set, spec, say)
    reference = steps.measure()            # before the change: the gates' reference
    steps.drain_and_stop()                 # no running requests (or the drain timeout), then TERM
    steps.change()                         # push + build, the overlay's tests on each host
    steps.launch()                         # the same topology and --set values as before
    results, after = steps.gates(reference)  # /health_generate, then the gates.py comparisons
    steps.register()                       # back into the router (passed or inconclusive)
    steps.put_back()                       # on a failure: the previous release, serving again
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import BuildError, DeployError, StateError
from ..ops.bench import Bench, BenchParams, probe_prompts
from ..ops.deploy import Options, push_host, rollback_host
from ..ops.kernel_build import BuildOptions, build_host, push_then_build
from ..ops.launch import launch, stop_quietly, wait_serving
from ..ops.overlay_tests import TestOptions, test_host
from ..ops.serving_checks import drain, health, router
from ..patchset import PatchSet
from ..render import launch_dir_for, render_hosts
from ..transport.agent_client import agent_session
from ..transport.protocol import StateReply
from ..transport.protocol_serving import Measurement
from .gates import GateResult, evaluate
from .plan import Unit
from .spec import RolloutSpec

COMMAND = "ddeploy rollout"
Say = Callable[[str, str], None]  # (message, host)


@dataclass
class UnitSteps:
    unit: Unit
    ps: PatchSet
    spec: RolloutSpec
    say: Say
    changed: dict[str, bool] = field(default_factory=dict)  # host -> its checkout was changed here (the log)

    @property
    def lead(self):
        """The host that serves HTTP (node rank 0 of a multi-node launch; inventory order)."""
        return self.unit.hosts[0]

    def _say(self, host: str) -> Callable[[str], None]:
        return lambda text: self.say(text, host)

    def _params(self) -> BenchParams:
        m = self.spec.measure
        return BenchParams(
            requests=m.requests,
            concurrency=(m.concurrency,),
            input_len=m.input_len,
            output_len=m.output_len,
            temperature=0.0,
            seed=m.seed,
            wait_timeout=self.spec.deadlines.launch_s,
            run_timeout=self.spec.deadlines.gates_s,
            timeout=self.spec.deadlines.gates_s,
            warmup=m.warmup,
            repeats=m.repeats,
        )

    def measure(self) -> Measurement:
        """The serving unit measured: the client's warm-up (discarded), `repeats` runs, then the
        greedy probes."""
        host, m = self.lead, self.spec.measure
        base = launch_dir_for(host)
        with agent_session(host, command=COMMAND) as agent:
            bench = Bench(agent, self._params(), self._say(host.name))
            served = bench.wait(base)
            # the model's vocabulary, from the unit's render (all its hosts: a multi-node topology
            # renders only with every node)
            units = render_hosts(list(self.unit.hosts), served.record.topology, tuple(served.record.sets))
            values = {v.key: v.value for v in units[0].values}
            prompts = probe_prompts(int(values["model_vocab_size"]), m.seed, m.probes)
            probes = {"prompts": prompts, "output_len": m.probe_tokens}
            return bench.measure(base, served.record, probes, None).measured[0]

    def drain_and_stop(self) -> None:
        """Each host: out of its router (when the inventory names one), then wait (up to the drain
        timeout) until its server runs no request, then stop it."""
        for host in self.unit.hosts:
            say = self._say(host.name)
            with agent_session(host, command=COMMAND) as agent:
                router(agent, "remove", say)
                left = drain(agent, self.spec.drain_timeout_s, say)
                if not left.drained:
                    say(f"drain timeout: stopping with {left.running} request(s) running, {left.queued} queued")
                stop_quietly(agent, launch_dir_for(host), say)

    def change(self) -> None:
        """Push (and build) the new release on every host, then the overlay's tests there."""
        popts = Options(command=COMMAND)
        for host in self.unit.hosts:
            say = self._say(host.name)
            if self.spec.steps.build:
                limit = self.spec.deadlines.build_s
                out = push_then_build(host, self.ps, popts, BuildOptions(command=COMMAND), say, timeout=limit)
            else:
                out = push_host(host, self.ps, popts, say)
            self.changed[host.name] = self.changed.get(host.name, False) or out.changed
        tests = self.spec.steps.tests
        if tests is False:
            return
        expr = None if tests is True else str(tests)
        for host in self.unit.hosts:
            test_host(host, TestOptions(expr=expr, requested=self.ps, command=COMMAND), self._say(host.name))

    def launch(self) -> None:
        serving = self.unit.serving
        if serving is None:
            return
        launch(
            list(self.unit.hosts),
            serving.topology,
            serving.sets,
            self.say,
            command=COMMAND,
            wait=self.spec.deadlines.launch_s,
        )

    def register(self) -> None:
        """Each host's serving units back into its router (a no-op for a host without one)."""
        for host in self.unit.hosts:
            if host.router is not None:
                with agent_session(host, command=COMMAND) as agent:
                    router(agent, "add", self._say(host.name))

    def health_gate(self) -> GateResult:
        """/health_generate on every host's serving units."""
        for host in self.unit.hosts:
            with agent_session(host, command=COMMAND) as agent:
                sick = [u for u in health(agent).units if u.status != 200]
            if sick:
                u = sick[0]
                why = f"HTTP {u.status}" if u.status is not None else (u.error or "no answer")
                return GateResult("health", "fail", f"{u.name} /health_generate: {why}", "HTTP 200")
        return GateResult("health", "pass", "/health_generate 200 on every unit", "HTTP 200")

    def gates(self, reference: Measurement) -> tuple[list[GateResult], Measurement | None]:
        """The health gate, then the candidate (returned too, for the log) against the reference."""
        first = self.health_gate()
        if first.verdict == "fail":
            return [first], None
        candidate = self.measure()
        return [first, *evaluate(reference, candidate, self.spec.gates, self.spec.measure.requests)], candidate

    def put_back(self) -> str | None:
        """The previous release serving again: stop what runs, roll back each checkout whose
        applied release is not the one it had (read from the host: a push cut off by its deadline
        may have applied or not), build (its kernels are cached from before), launch as before.
        None when done, else why not (the rollout then says what is left to do by hand)."""
        problems = []
        for host, before in zip(self.unit.hosts, self.unit.versions or [None] * len(self.unit.hosts), strict=True):
            say = self._say(host.name)
            try:
                with agent_session(host, command=COMMAND) as agent:
                    stop_quietly(agent, launch_dir_for(host), say)
                    applied = agent.call("state", {}, StateReply).state.applied
                if (applied.version if applied else None) != before:
                    # to the release it had (none: the pre-deploy state), whatever came between
                    rollback_host(host, Options(command=COMMAND, to=before), say)
                    if self.spec.steps.build:
                        self._rebuild(host, say)
                self.changed[host.name] = False
            except DeployError as exc:
                problems.append(f"{host.name}: {exc}")
        if problems:
            return "; ".join(problems)
        try:
            self.launch()
        except DeployError as exc:
            return f"the previous launch did not start again: {exc}"
        if self.unit.serving is not None:
            try:
                self.register()
            except DeployError as exc:
                return f"the previous launch serves again but is not back in its router: {exc}"
        return None

    def _rebuild(self, host, say: Callable[[str], None]) -> None:
        """The previous release's kernels after its rollback (a cache hit when it was built here
        before); a failed build is said, not raised: the previous launch must serve again, and
        its JIT kernels then compile at first use, as they did before any build."""
        try:
            build_host(host, BuildOptions(command=COMMAND), say)
        except BuildError as exc:
            say(f"the previous release's kernel build failed ({exc}); launching it without a build")

    def serves_now(self) -> bool:
        """Whether the unit's lead host serves (a resumed unit may have been stopped mid-way)."""
        with agent_session(self.lead, command=COMMAND) as agent:
            try:
                wait_serving(agent, 5.0, self._say(self.lead.name))
            except StateError:
                return False
        return True
