"""The rollout file (`ddeploy rollout --file rollout.yaml`): how a fleet moves, what is measured,
and the thresholds of the gates. Every field has a default, so no file is needed; CLI options
(--batch, --max-fail, --min-available, --drain-timeout) override the file's.

    batch: [1, 5, "20%"]          # after the canary: 1 unit, then 5, then 20% of all, repeated
    max_fail: 0                   # units that may fail (and go back) before the rollout aborts
    min_available: 0              # units that must still serve while a batch is changed
    drain_timeout_s: 300
    rollback_window_h: 0          # back to a release a unit passed within this many hours: no gates
    deadlines: {build_s: 3600, launch_s: 1800, gates_s: 1800}
    steps: {build: true, tests: "not engine"}   # tests: a pytest -k expression, or false
    measure: {requests: 16, concurrency: 4, input_len: 256, output_len: 128, warmup: 1,
              repeats: 3, probes: 8, probe_tokens: 64, seed: 1}
    gates: {accept_length_drop_pct: 5, throughput_drop_pct: 10, itl_p99_rise_pct: 10}
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import UsageError

STEP = re.compile(r"^(\d+)(%?)\Z")


def step_value(text: str) -> tuple[int, bool]:
    """A ramp step or max_fail as (number, is a percentage); ValueError when it is neither."""
    m = STEP.match(text)
    if not m or (m.group(2) and int(m.group(1)) > 100):
        raise ValueError(f"{text!r} must be a count (1, 5) or a percentage (1% to 100%)")
    return int(m.group(1)), bool(m.group(2))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Deadlines(_Strict):
    build_s: float = Field(3600.0, gt=0, description="push and kernel build of one unit")
    launch_s: float = Field(1800.0, gt=0, description="weights and CUDA graphs: until the unit serves")
    gates_s: float = Field(1800.0, gt=0, description="one measurement (reference or candidate)")


class Steps(_Strict):
    build: bool = True
    tests: str | bool = Field("not engine", description="the overlay's tests on the host: -k expression, false: none")


class Measure(_Strict):
    requests: int = Field(16, ge=1)
    concurrency: int = Field(4, ge=1)
    input_len: int = Field(256, ge=1)
    output_len: int = Field(128, ge=1)
    warmup: int = Field(1, ge=0, description="client runs before the measured ones, discarded")
    repeats: int = Field(3, ge=1, description="client runs per measurement: their spread is the noise")
    probes: int = Field(8, ge=1, description="fixed prompts whose greedy completions must not change")
    probe_tokens: int = Field(64, ge=1)
    seed: int = 1


class Thresholds(_Strict):
    accept_length_drop_pct: float = Field(5.0, ge=0)
    throughput_drop_pct: float = Field(10.0, ge=0)
    itl_p99_rise_pct: float = Field(10.0, ge=0)


class RolloutSpec(_Strict):
    batch: tuple[str, ...] = ("1",)
    max_fail: str = "0"
    min_available: int = Field(0, ge=0)
    drain_timeout_s: float = Field(300.0, ge=0)
    rollback_window_h: float = Field(
        0.0, ge=0, description="a unit moving to a release it passed its gates on this long ago skips them (0: off)"
    )
    deadlines: Deadlines = Deadlines()
    steps: Steps = Steps()
    measure: Measure = Measure()
    gates: Thresholds = Thresholds()

    @field_validator("batch", mode="before")
    @classmethod
    def _batch(cls, v: object) -> object:
        items = v if isinstance(v, (list, tuple)) else str(v).split(",")
        out = tuple(str(i).strip() for i in items)
        for item in out:
            if step_value(item)[0] == 0:
                raise ValueError(f"batch step {item!r} must be at least 1")
        if not out:
            raise ValueError("batch needs at least one step")
        return out

    @field_validator("max_fail", mode="before")
    @classmethod
    def _max_fail(cls, v: object) -> object:
        text = str(v).strip()
        step_value(text)
        return text

    def max_failures(self, units: int) -> int:
        """How many units may fail (each put back) before the rollout aborts."""
        n, percent = step_value(self.max_fail)
        return units * n // 100 if percent else n


def load_spec(path: Path | None, overrides: dict[str, object]) -> RolloutSpec:
    """The rollout file (None: defaults) with the CLI's options over it; bad input is one line
    naming the file and the field."""
    data: dict[str, object] = {}
    where = "the rollout options"
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise UsageError(f"cannot read the rollout file {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise UsageError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"{path}: a rollout file is a mapping (batch:, gates:, ...)")
        data = loaded
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RolloutSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "?"
        raise UsageError(f"{where}: {field}: {err['msg'].removeprefix('Value error, ')}") from None
