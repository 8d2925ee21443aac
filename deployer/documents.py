"""Every YAML document the tool reads, as pydantic models, and the one way their errors read:
`file: field: message` (the file, then the dotted field, then what is wrong with it).

    manifest.yaml        ManifestDoc     (patches/<name>/<version>/)
    archive.yaml         ArchiveDoc      (patches/<name>/: releases outside the window)
    concerns.yaml        ConcernsDoc     (overlays/<name>/)
    hardware.yaml        HardwareDoc     (templates/)
    topologies.yaml      TopologiesDoc   (templates/)
    defaults.yaml        DefaultsDoc     (templates/)
    hosts/*.yaml         deployer.inventory.Host (same formatter)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, field_validator

from .errors import DeployError

# PyYAML's libyaml-backed safe loader when PyYAML was built with it (the same documents, parsed in
# C), else the pure-Python one.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

M = TypeVar("M", bound=BaseModel)
ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*\Z")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")


def field_error(err: ValidationError) -> str:
    """`field.path: message (+N more)` for the first problem of a validation error."""
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{loc}: {msg}{more}"


def read_yaml(path: Path, error: type[DeployError], what: str) -> Any:
    """The parsed document; a missing, unreadable or invalid file is `error` naming path and why."""
    try:
        return yaml.load(path.read_text(), Loader=SAFE_LOADER)  # noqa: S506 - a safe loader
    except FileNotFoundError:
        raise error(f"{path}: missing {what}") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except UnicodeDecodeError:
        raise error(f"{path}: cannot read the {what} (not UTF-8 text)") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None


def validate(path: Path | str, model: type[M], data: Any, error: type[DeployError]) -> M:
    """data as model, or `error`: `file: field: message`."""
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{path}: {field_error(exc)}") from None


def load_document(path: Path, model: type[M], error: type[DeployError], what: str) -> M:
    return validate(path, model, read_yaml(path, error, what), error)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


# --- manifest.yaml ------------------------------------------------------------------------------


class ManifestBase(_Doc):
    sglang: str
    tree: str


class ManifestPatch(_Doc):
    name: str
    concern: str = ""
    sha256: str
    files: list[str] = []

    @field_validator("name")
    @classmethod
    def _plain(cls, v: str) -> str:
        if "/" in v or v.startswith(".") or not v:
            raise ValueError(f"patch name {v!r} must be a plain file name")
        return v


class Skipped(_Doc):
    concern: str
    reason: str = ""


class ManifestDoc(_Doc):
    name: str
    version: str
    created: str = ""
    base: ManifestBase
    patches: list[ManifestPatch]
    skipped: list[Skipped] = []

    @field_validator("created", mode="before")
    @classmethod
    def _date_as_text(cls, v: Any) -> Any:
        return str(v) if v is not None else ""

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, (int, float)) else v


# --- archive.yaml -------------------------------------------------------------------------------


class ArchivedRelease(_Doc):
    version: str
    created: str = ""
    tag: str
    commit: str = Field(pattern=r"^[0-9a-f]{40}$", description="the commit that added the release")
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("version", "created", mode="before")
    @classmethod
    def _as_text(cls, v: Any) -> Any:
        return str(v) if v is not None else ""


class ArchiveDoc(_Doc):
    archived: list[ArchivedRelease] = []


# --- concerns.yaml ------------------------------------------------------------------------------


class ConcernDoc(_Doc):
    id: str
    title: str
    description: str
    files: list[str] = []
    hunks: list[str] = []

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not ID_RE.match(v):
            raise ValueError(f"concern id {v!r} must be lower-case letters, digits and '-'")
        return v

    @field_validator("title")
    @classmethod
    def _title(cls, v: str) -> str:
        v = v.strip()
        if not v or "\n" in v:
            raise ValueError("'title' must be one non-empty line")
        return v

    @field_validator("description")
    @classmethod
    def _description(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("'description' (what the patch is for) is required")
        return v.strip()

    @field_validator("files", "hunks", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return [] if v is None else v

    @field_validator("files", "hunks")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not all(v):
            raise ValueError("must be a list of non-empty strings")
        return v


class ConcernsDoc(_Doc):
    name: str | None = None
    ignore: list[str] = []
    concerns: list[ConcernDoc] = Field(min_length=1)

    @field_validator("ignore", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return [] if v is None else v


# --- templates/*.yaml ---------------------------------------------------------------------------


class HardwareMatch(_Doc):
    arch: str
    interconnect: str


class HardwareProfileDoc(_Doc):
    description: str = ""
    match: HardwareMatch
    unavailable_attention_backends: dict[str, str] = {}
    unavailable_a2a_backends: dict[str, str] = {}
    values: dict[str, Any] = {}

    @field_validator("unavailable_attention_backends", "unavailable_a2a_backends", "values", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return {} if v is None else v


class HardwareDoc(RootModel[dict[str, HardwareProfileDoc]]):
    pass


class TopologyDoc(_Doc):
    description: str = ""
    # The CPU engine profile: renders only for hosts with `cpu_engine: true` (docs/serving.md).
    cpu_engine: bool = False
    values: dict[str, Any] = {}

    @field_validator("values", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return {} if v is None else v


class TopologiesDoc(RootModel[dict[str, TopologyDoc]]):
    @field_validator("root")
    @classmethod
    def _names(cls, v: dict[str, TopologyDoc]) -> dict[str, TopologyDoc]:
        for name in v:  # names become file and directory names on hosts
            if not NAME_RE.match(str(name)):
                raise ValueError(f"topology name {name!r} must be letters, digits, '_', '.', '-'")
        return v


class DefaultsDoc(RootModel[dict[str, Any]]):
    """Every key is a render value; its type is its default's (the schema of --set and vars)."""

    @field_validator("root")
    @classmethod
    def _values(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, value in v.items():
            if key == "env":
                if not isinstance(value, dict):
                    raise ValueError("'env' must be a mapping of variable names to values")
            elif isinstance(value, dict):
                raise ValueError(f"'{key}' must be a single value or a list, not a mapping")
        return v
