"""The rollout itself: the canary alone, behind a barrier (nothing else moves until it has passed
its gates), then each batch. A batch's units move one after another in this process, so that
Ctrl-C lands in the step at work (each of ddeploy's operations stops what it started there): one
unit is out of service at a time, and a batch is what the checks between batches (max fail, pause)
and an abort act on.

- A unit that fails (a step raises, or a gate fails) goes back to its previous release at once
  (unit_steps.put_back) and counts against max_fail. The canary failing, or failures past
  max_fail, abort: the rest of the failed batch goes back too, no further unit is touched, and the
  rollout ends `failed`.
- An inconclusive gate (a change inside the runs' noise) pauses the rollout after its batch: the
  unit keeps the new release and serves, and `ddeploy rollout --resume` goes on (the operator's
  acceptance), or `ddeploy rollback` puts it back by hand.
- Ctrl-C puts the units in flight back (a second Ctrl-C leaves them as they are) and ends
  `interrupted`; `--resume` redoes those units from their start, never a finished one. A killed
  client leaves no final event: `--resume` does the same.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import DeployError
from ..patchset import PatchSet
from ..transport.protocol_serving import Measurement
from .gates import verdict
from .journal import Journal, Replay, passed_recently
from .plan import Plan, Unit
from .spec import RolloutSpec
from .unit_steps import UnitSteps

Say = Callable[[str, str], None]  # (message, host or unit)
ROLLOUT = "rollout"  # the prefix of the rollout's own lines
FAILED = ("rolled-back", "put-back-failed")  # a unit's results that count against max fail


class Rollout:
    def __init__(self, plan: Plan, spec: RolloutSpec, ps: PatchSet, journal: Journal, say: Say, past: Replay | None):
        self.plan, self.spec, self.ps, self.journal, self.say = plan, spec, ps, journal, say
        self.past = past
        self.finished: dict[str, str] = dict(past.finished) if past else {}
        self.failures = past.failures if past else 0
        self.steps: dict[str, UnitSteps] = {}

    def run(self) -> str:
        """The rollout's end state: done, failed, paused or interrupted."""
        try:
            state = self._batches()
        except KeyboardInterrupt:
            self.journal.write("interrupted")
            self._put_back_in_flight()
            state = "interrupted"
        self.journal.write("rollout", state=state, failures=self.failures)
        return state

    def _batches(self) -> str:
        for i, batch in enumerate(self.plan.batches):
            todo = [name for name in batch if name not in self.finished]
            if not todo:
                continue
            label = "canary" if i == 0 else f"batch {i}"
            self.journal.write("batch", index=i, label=label, units=todo)
            self.say(f"{label}: {', '.join(todo)}", ROLLOUT)
            results = {name: self._roll(name) for name in todo}
            failed = [name for name, result in results.items() if result in FAILED]
            self.failures += len(failed)
            if failed and (i == 0 or self.failures > self.plan.max_failures):
                over = f"{self.failures} failure(s), over max fail {self.plan.max_failures}"
                why = "the canary failed" if i == 0 else over
                passed = [n for n, r in results.items() if r in ("pass", "inconclusive")]
                back = f"; {label}'s units that passed go back too: {', '.join(passed)}" if passed else ""
                self.say(f"aborting: {why}{back}; no further unit is touched", ROLLOUT)
                self._put_back(passed, label)
                return "failed"
            if "inconclusive" in results.values():
                self.say(f"paused after {label}: a gate was inconclusive (`ddeploy rollout --resume` goes on)", ROLLOUT)
                return "paused"
        return "done"

    def _roll(self, name: str) -> str:
        """One unit from start to its gates' verdict; put back on any failure."""
        unit = self.plan.unit(name)
        steps = UnitSteps(unit, self.ps, self.spec, self.say)
        self.steps[name] = steps
        self.journal.write("unit", unit=name, step="start")
        try:
            result = self._change(unit, steps)
        except DeployError as exc:
            self.journal.write("unit", unit=name, step="failed", error=str(exc))
            self.say(f"failed: {exc}", name)
            result = "fail"
        if result == "fail":
            why = steps.put_back()
            self.journal.write("put-back", unit=name, ok=why is None, problem=why)
            if why is not None:
                self.say(f"could not put back the previous release: {why}", name)
            result = "rolled-back" if why is None else "put-back-failed"
        self.journal.write("unit-done", unit=name, result=result)
        self.finished[name] = result
        return result

    def _change(self, unit: Unit, steps: UnitSteps) -> str:
        name = unit.name
        reference = None
        window = self.spec.rollback_window_h * 3600
        recent = passed_recently(name, self.plan.version, window) if unit.serving is not None else None
        if recent is not None:
            when = f"in rollout {recent[0]} at {recent[1]}"
            window_h = f"{self.spec.rollback_window_h:g} h"
            self.say(f"passed its gates on {self.plan.version} {when}, within the rollback window ({window_h}): "
                     "only /health_generate is checked", name)  # fmt: skip
            self.journal.write("rollback-window", unit=name, rollout=recent[0], passed_at=recent[1])
        if unit.serving is not None:
            serving_now = steps.serves_now()  # asked once: a resumed unit may be stopped already
            kept = self.past.references.get(name) if self.past else None
            if recent is not None:
                pass  # within the rollback window: nothing to compare with, only the health gate
            elif kept is not None:
                reference = Measurement.model_validate(kept)
            elif serving_now:
                self._step(name, "reference")
                reference = steps.measure()
                self.journal.write("reference", unit=name, measurement=reference.to_data())
            if serving_now:
                self._step(name, "drain")
                steps.drain_and_stop()
        self._step(name, "change")
        steps.change()
        for host, changed in steps.changed.items():
            self.journal.write("pushed", unit=name, host=host, changed=changed)
        if unit.serving is None:
            return "pass"
        self._step(name, "launch")
        steps.launch()
        if reference is None:
            if recent is None:
                self.say("no reference measured before the change (the unit was not serving): gates skipped", name)
            health = steps.health_gate()
            self.journal.write("gate", unit=name, **health.to_data())
            self.say(f"gate {health.gate}: {health.verdict}: {health.measured} ({health.threshold})", name)
            if health.verdict == "fail":
                return "fail"
            steps.register()
            return "pass"
        self._step(name, "gates")
        results, candidate = steps.gates(reference)
        if candidate is not None:
            self.journal.write("candidate", unit=name, measurement=candidate.to_data())
        for r in results:
            self.journal.write("gate", unit=name, **r.to_data())
            self.say(f"gate {r.gate}: {r.verdict}: {r.measured} ({r.threshold})", name)
        result = verdict(results)
        if result != "fail" and any(h.router for h in unit.hosts):
            self._step(name, "register")
            steps.register()
        return result

    def _step(self, unit: str, step: str) -> None:
        self.journal.write("unit", unit=unit, step=step)
        self.say(step, unit)

    def _put_back(self, names: list[str], label: str) -> None:
        for name in names:
            why = self.steps[name].put_back()
            self.journal.write("put-back", unit=name, ok=why is None, problem=why, cause=f"{label} aborted")
            if why is not None:
                self.say(f"could not put back the previous release: {why}", name)
            result = "rolled-back" if why is None else "put-back-failed"
            self.journal.write("unit-done", unit=name, result=result)
            self.finished[name] = result

    def _put_back_in_flight(self) -> None:
        in_flight = [n for n in self.steps if n not in self.finished]
        if not in_flight:
            return
        self.say(f"interrupted: putting back {', '.join(in_flight)} (Ctrl-C again leaves them as they are)", ROLLOUT)
        try:
            for name in in_flight:
                why = self.steps[name].put_back()
                self.journal.write("put-back", unit=name, ok=why is None, problem=why, cause="interrupted")
        except KeyboardInterrupt:
            self.say("left as they are; `ddeploy rollout --resume` redoes them", ROLLOUT)


def summary(plan: Plan, finished: dict[str, str]) -> list[dict[str, Any]]:
    return [{"unit": u.name, "result": finished.get(u.name, "not touched")} for u in plan.units]
