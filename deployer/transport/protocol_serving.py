"""The agent protocol's launch and bench replies: launched units, what they serve, the launch
record (launch.json as the client sees it), the serving checks (drain, health) and the
benchmark's measurements. Imported from here: protocol.py cannot re-export them (this module
builds on its Record and Reply)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .protocol import Record, Reply


class LaunchedUnit(Record):
    name: str
    pid: int
    starttime: str
    log: str
    script_file: str | None = None
    url: str | None = Field(default=None, description="where the agent polls it on the host (launch --wait, bench)")


class Serving(Record):
    """What a unit really serves, from its /server_info (launch --wait, bench)."""

    config: str = Field(description='"ddtree", "linear" (DFlash without a tree), "plain" (no speculation)')
    model: str | None = None
    model_path: str | None = None
    speculative_algorithm: str | None = None
    verify_width: int | None = Field(default=None, description="speculative_num_draft_tokens (B + 1 with DDTree)")
    tree_budget: int | None = None
    tree_topk: int | None = None
    attention_backend: str | None = None
    tp_size: int | None = None
    ep_size: int | None = None
    version: str | None = None
    unit: str | None = None
    url: str | None = None


class LaunchRecord(Record):
    id: str | None = Field(default=None, description="unique per start; records are replaced by compare-and-swap on it")
    topology: str
    dir: str
    state: Literal["running", "stopped", "failed"]
    variant: str | None = Field(default=None, description="a bench baseline (linear, plain); None: as rendered")
    sets: list[str] = []
    started_at: str | None = None
    stopped_at: str | None = None
    failure: str | None = None
    units: list[LaunchedUnit] = []
    serving: list[Serving] = []


class LaunchReply(Reply):
    record: LaunchRecord
    serving: list[Serving] = []


class WaitReply(Reply):
    record: LaunchRecord
    serving: list[Serving]


class DrainReply(Reply):
    """`drain`: the units' requests at its last poll (SGLang's gauges, summed over the units)."""

    drained: bool = Field(description="every unit read 0 running and 0 queued before the timeout")
    running: int
    queued: int
    waited_s: float


class UnitHealth(Record):
    name: str
    url: str
    status: int | None = Field(default=None, description="/health_generate's HTTP status (200: it generated)")
    error: str | None = Field(default=None, description="why no status came back (refused, timed out)")


class HealthReply(Reply):
    units: list[UnitHealth]


class BenchRun(Record):
    """One run of SGLang's benchmark client at one concurrency (its own JSON result's numbers)."""

    concurrency: int
    completed: int | None = None
    duration_s: float | None = None
    output_tokens: int | None = None
    output_tokens_per_s: float | None = None
    ttft_ms_median: float | None = None
    ttft_ms_p99: float | None = None
    itl_ms_median: float | None = None
    itl_ms_p99: float | None = None
    accept_length: float | None = None
    verify_count: int | None = Field(default=None, description="the server's verify steps in the run (/metrics)")


class Probe(Record):
    output_ids: list[int]
    verify_count: int | None = None
    completion_tokens: int | None = None


class Measurement(Record):
    """One launch measured by `bench`: the warm-up runs, the client `repeats` times per concurrency,
    then the greedy probes."""

    record: LaunchRecord
    serving: Serving
    server_args: dict[str, Any] = {}
    warmup: int = Field(default=0, description="client runs made at the first concurrency and discarded")
    runs: list[BenchRun] = Field(description="every measured run, per concurrency `repeats` in a row")
    probes: list[Probe] | None = None


class BenchReply(Reply):
    measured: list[Measurement] = Field(description="the serving launch, then (compare) its baseline")
    restored: LaunchRecord | None = Field(default=None, description="compare: the launch, serving again")


class BenchSaveReply(Reply):
    history: str


class LogsReply(Reply):
    rc: int
    files: list[str]


class StopReply(Reply):
    record: LaunchRecord
    outcome: dict[str, Literal["terminated", "killed"]]


class RouterWorker(Record):
    unit: str
    worker: str = Field(description="the worker's URL as the router knows it")
    done: str = Field(description='"remove", "add", "already registered", ... (legacy: the call made)')


class RouterReply(Reply):
    workers: list[RouterWorker]
