"""The agent protocol: what the client sends and what each agent operation replies, as typed models.

The agent (deployer/agent/) is stdlib-only and writes plain JSON; the client validates
every reply into these models, so a foreign or broken agent is one clear error, never a KeyError
deep in a command. These are also the host's on-disk records as the client sees them (state.json,
the lock owner; launch.json in protocol_serving.py); the agent alone reads and writes them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Record(BaseModel):
    """Tolerant of fields a newer agent adds; `from` is a Python keyword, hence the aliases."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, defer_build=True)

    def to_data(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


class AgentError(Record):
    kind: str = "RemoteCommandError"
    message: str = "unknown agent error"


class LockOwner(Record):
    by: str = "?"
    user: str | None = None
    host: str | None = None
    pid: int | None = None
    time: float | None = None
    command: str | None = None
    alive: bool | None = Field(default=None, description="False: nobody holds the lock (a dead holder's record)")


class AppliedPatch(Record):
    name: str
    sha256: str
    commit: str


class Applied(Record):
    name: str
    version: str
    fingerprint: str
    patches: list[AppliedPatch] = []
    files: list[str] = []
    head: str
    tree: str | None = None
    three_way: bool = False
    dev: bool = Field(default=False, description="a dev snapshot of the overlay (push --overlay), not a release")
    by: str | None = None
    at: str | None = None


class PreDeploy(Record):
    commit: str
    tree: str | None = None
    branch: str | None = None


class LastAction(Record):
    action: Literal["push", "rollback"]
    version: str | None = None
    dev: bool = False
    from_: str | None = Field(default=None, alias="from")
    by: str | None = None
    at: str | None = None
    saved: str | None = None


class BuildModule(Record):
    module: str | None = None
    status: str | None = None
    seconds: float | None = None
    path: str | None = None
    reason: str | None = None


class BuildRecord(Record):
    ok: bool | None = None
    nvcc: str | None = None
    cuda_home: str | None = None
    source_hash: str | None = None
    cache_dir: str | None = None
    version: str | None = None
    at: str | None = None
    modules: list[BuildModule] = []
    known: dict[str, "BuildRecord"] = {}


class TestRecord(Record):
    __test__ = False  # not a pytest class

    ok: bool | None = None
    rc: int | None = None
    version: str | None = None
    k: str | None = None
    at: str | None = None
    report: str | None = None
    tests: int | None = None
    passed: int | None = None
    failed: int | None = None
    errors: int | None = None
    skipped: int | None = None
    duration: float | None = None
    summary: str | None = None


class HostState(Record):
    """refs/ddeploy/state:state.json (schema 1); the agent's docstring describes the chain."""

    schema_: int = Field(default=1, alias="schema")
    applied: Applied | None = None
    pre_deploy: PreDeploy | None = None
    last: LastAction | None = None
    builds: dict[str, BuildRecord] = {}
    tests: TestRecord | None = None
    bench: dict[str, Any] | None = Field(default=None, description="the last `ddeploy bench` (docs/json.md)")


class BaseMismatch(Record):
    """One file the set touches whose content is not what its patches were made against."""

    path: str
    why: str
    expected: str | None = None  # blob id the first patch touching it expects; None: the set creates it
    actual: str | None = None  # blob id in the checkout's commit; None: absent


class BaseCheck(Record):
    """The exact base gate: every touched file holds the patches' preimage blob (docs/remote.md)."""

    commit: str
    against: str
    checked: int
    mismatched: list[BaseMismatch] = []


class LaunchSummary(Record):
    """`status`: the host's last launch, from its launch record (docs/serving.md)."""

    id: str | None = None
    topology: str | None = None
    state: str | None = Field(default=None, description="running, stopped or failed, as recorded")
    variant: str | None = None
    started_at: str | None = None
    stopped_at: str | None = None
    failure: str | None = None
    units: int = 0
    alive: int = Field(default=0, description="units whose leader still runs (the recorded pid and start time)")
    error: str | None = Field(default=None, description="the record could not be read")


class Facts(Record):
    head: str
    tree: str | None = None
    branch: str | None = None
    state: HostState
    state_commit: str | None = None
    drift: list[str] = []
    lock: LockOwner | None = None
    journal: bool = False
    base: BaseCheck | None = None  # status: the touched files at the pre-deploy commit (or HEAD)
    launch: LaunchSummary | None = None  # status: the host's last launch


class PlanPatch(Record):
    name: str
    files: list[str]
    ok: bool
    error: str | None = None


class Plan(Record):
    action: Literal["apply", "replace", "noop", "restore"]
    version: str
    from_: str | None = Field(default=None, alias="from")
    pre_deploy: str
    head: str
    files: list[str]
    patches: list[PlanPatch] = []
    drift: list[str] = []
    in_the_way: list[str] = []  # of drift: untracked paths where the set writes (a file where it makes a dir)
    blocked: str | None = None
    blocked_kind: Literal["DriftError", "BaseTreeError", "ConflictError"] | None = None
    base: BaseCheck | None = None


class Reply(Record):
    ok: bool
    error: AgentError | None = None


class StatusReply(Reply):
    facts: Facts


class StateReply(Reply):
    state: HostState


class PlanDiff(Record):
    """`plan --diff`: HEAD's tree -> the tree push would switch to, over the old and new sets' files."""

    files: list[str] = []
    text: str | None = Field(default=None, description="the unified diff; None when the series does not apply")
    bytes: int = Field(default=0, description="the whole diff's size; text holds at most the agent's DIFF_LIMIT")
    truncated: bool = False
    note: str | None = None


class PlanReply(Reply):
    plan: Plan
    facts: Facts
    diff: PlanDiff | None = None


class PushReply(Reply):
    changed: bool
    plan: Plan
    applied: Applied | None = None
    saved: str | None = None
    recovered: bool = False


class RollbackReply(Reply):
    changed: bool
    message: str | None = None
    from_: str | None = Field(default=None, alias="from")
    to: str | None = None
    head: str | None = None
    tree: str | None = None
    saved: str | None = None
    recovered: bool = False


class LogEntry(Record):
    commit: str
    date: str
    message: str
    last: LastAction | None = None


class LogReply(Reply):
    entries: list[LogEntry]


class LockReply(Reply):
    lock: LockOwner | None


class LockReleaseReply(Reply):
    released: bool
    lock: LockOwner | None


class TestReply(Reply):
    __test__ = False

    record: TestRecord
    junit: str | None = Field(default=None, description="the JUnit XML report, None when pytest wrote none")
    host_report: str
    push: PushReply | None = Field(
        default=None, description="the push of the dev snapshot before the tests (--overlay)"
    )
