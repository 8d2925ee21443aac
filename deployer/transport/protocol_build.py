"""The agent protocol's kernel-build replies and the build's view of a host (`build`,
`sources`, `push-build`'s build): the plan, the toolkit it found, and the inventory's `Target`.
Split from protocol.py, whose base models it uses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .protocol import Record, Reply


class Toolkit(Record):
    cuda_home: str
    nvcc: str


class BuildPlan(Record):
    host: str
    arch: str
    capability: tuple[int, int]
    toolkit: Toolkit
    source_hash: str
    version: str
    gpu: str | None = None
    cache_dir: str
    packages: dict[str, str | None] = Field(
        default_factory=dict, description="versions of torch, flashinfer-python, apache-tvm-ffi (None: absent)"
    )
    action: Literal["build", "noop"]
    reason: str
    key: str
    previous_cache_dir: str | None = None


class BuildReply(Reply):
    changed: bool
    plan: BuildPlan
    build: dict[str, Any] | None = Field(default=None, description="the prebuild's own JSON summary")


class SourcesReply(Reply):
    source_hash: str | None


class Target(Record):
    """What the agent needs to know about the host from the inventory (names its errors too)."""

    name: str
    source: str
    python: str
    arch: str
    capability: tuple[int, int]
    model: str
    cuda_home: str | None = None
    cache_root: str | None = None
