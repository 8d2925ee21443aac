"""Render values and where each came from.

Precedence, lowest first: defaults < hardware profile < topology < host inventory (derived facts,
then `vars`) < `--set key=value`. Types come from the defaults (or the derived fact): a value
from YAML or the command line is coerced to that type, or the error names the key and the source.
"""

from __future__ import annotations

import difflib
import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any

from ..errors import RenderError, UsageError
from ..inventory import Host
from .profiles import HardwareProfile, Profiles, Topology

ENV_PREFIX = "env."
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# Facts derived from the host that vars or --set may override (the rest are read-only facts).
SETTABLE_FACTS = {"node_addr": str, "launch_dir": str, "server_command": list}


@dataclass(frozen=True)
class Value:
    key: str
    value: Any
    source: str


def flatten(values: dict[str, Any]) -> dict[str, Any]:
    """`env: {A: 1}` -> `env.A: "1"`; other keys unchanged."""
    out = {k: v for k, v in values.items() if k != "env"}
    for name, val in (values.get("env") or {}).items():
        out[ENV_PREFIX + str(name)] = val
    return out


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _number(raw: Any, kind: type) -> int | float:
    if isinstance(raw, bool):
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}")
    try:
        return kind(raw) if kind is float or isinstance(raw, int) else int(str(raw), 10)
    except (TypeError, ValueError):
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None


def _convert(raw: Any, kind: type) -> Any:
    if kind is bool:
        return _bool(raw)
    if kind in (int, float):
        return _number(raw, kind)
    if kind is list:
        if isinstance(raw, (list, tuple)):
            return [str(x) for x in raw]
        return shlex.split(str(raw))
    if isinstance(raw, (dict, list)):
        raise ValueError("expected a single value")
    return str(raw)


def _one_line(value: Any) -> Any:
    """Refuse newlines/control characters: a template may print a value in a `#` comment, where a
    newline would start a shell command."""
    for text in value if isinstance(value, list) else [value]:
        if isinstance(text, str) and any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in text):
            raise ValueError("must be one line (no newline or control characters)")
    return value


class Schema:
    """The known keys and their types: the defaults, the settable facts, and env.NAME."""

    def __init__(self, defaults: dict[str, Any]):
        self.types: dict[str, type] = {k: type(v) for k, v in flatten(defaults).items() if not k.startswith(ENV_PREFIX)}
        self.types.update(SETTABLE_FACTS)

    def coerce(self, key: str, raw: Any, source: str) -> Any:
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :]
            if not ENV_NAME_RE.match(name):
                raise RenderError(f"{source}: '{key}' is not a valid environment variable name")
            try:
                return None if raw is None or raw == "" else _one_line(str(raw))
            except ValueError as exc:
                raise RenderError(f"{source}: {key}={raw!r}: {exc}") from None
        if key not in self.types:
            close = difflib.get_close_matches(key, list(self.types), n=3, cutoff=0.6)
            hint = f" (did you mean: {', '.join(close)}?)" if close else " (see `ddeploy render --explain`)"
            raise RenderError(f"{source}: unknown key '{key}'{hint}")
        try:
            return _one_line(_convert(raw, self.types[key]))
        except ValueError as exc:
            raise RenderError(f"{source}: {key}={raw!r}: {exc}") from None


def parse_sets(items: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """`key=value` strings from the command line, in order (a later one wins)."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or key != key.strip():
            raise UsageError(f"malformed --set '{item}': expected key=value (e.g. --set tree_budget=128)")
        pairs.append((key, value))
    return pairs


def host_facts(host: Host) -> dict[str, Any]:
    """What the inventory says about the host, as render values."""
    parent = posixpath.dirname(host.checkout.rstrip("/")) or "/"
    address = host.ssh.host if host.ssh else "127.0.0.1"  # vars.node_addr overrides an ssh alias
    return {
        "host_name": host.name,
        "gpu_model": host.gpu.model,
        "gpu_count": host.gpu.count,
        "gpu_arch": host.gpu.arch,
        "gpu_memory_gib": host.gpu.memory_gib,
        "interconnect": host.interconnect,
        "checkout": host.checkout,
        "python": host.python,
        "node_addr": str(address),
        "launch_dir": posixpath.join(parent, "ddeploy-launch"),
        "server_command": [host.python, "-m", "sglang.launch_server"],
    }


def _layer(schema: Schema, out: dict[str, Value], values: dict[str, Any], source: str, *, typed: bool = True) -> None:
    for key, raw in flatten(values).items():
        value = schema.coerce(key, raw, source) if typed else raw
        out[key] = Value(key, value, source)


def resolve(
    profiles: Profiles,
    host: Host,
    topology: Topology,
    hardware: HardwareProfile,
    sets: list[tuple[str, str]],
    probed: tuple[dict[str, Any], str] | None = None,
) -> dict[str, Value]:
    """Every render value for one host, with the layer it came from. `probed`: (values, source)
    read from the host itself (e.g. its kernel build record), between inventory facts and vars."""
    schema = Schema(profiles.defaults)
    out: dict[str, Value] = {}
    _layer(schema, out, profiles.defaults, f"defaults ({profiles.directory.name}/defaults.yaml)")
    if not topology.cpu_engine:  # the CPU engine uses no GPU: the hardware profile does not apply
        _layer(schema, out, hardware.values, f"hardware profile {hardware.name}")
    _layer(schema, out, topology.values, f"topology {topology.name}")
    _layer(schema, out, host_facts(host), f"host {host.name} inventory ({host.source})", typed=False)
    _layer(schema, out, {f"{ENV_PREFIX}{k}": v for k, v in host.env.items()}, f"host {host.name} env ({host.source})")
    if probed:
        _layer(schema, out, probed[0], probed[1])
    _layer(schema, out, host.vars, f"host {host.name} vars ({host.source})")
    for key, raw in sets:
        out[key] = Value(key, schema.coerce(key, raw, "--set"), "--set")
    if topology.cpu_engine:
        facts = cpu_engine_facts(out["launch_dir"].value)
        _layer(schema, out, facts, f"cpu engine profile {topology.name}", typed=False)
    return out


def cpu_engine_facts(launch_dir: str) -> dict[str, Any]:
    """What the CPU engine profile serves: the tiny models its script writes at start (the overlay's
    cpu_engine.local_profile) beside the launch scripts; not settable."""
    engine = posixpath.join(launch_dir, "cpu-engine")
    return {
        "cpu_engine_dir": engine,
        "model_path": posixpath.join(engine, "models", "target"),
        "draft_model_path": posixpath.join(engine, "models", "draft"),
    }


def plain(values: dict[str, Value]) -> dict[str, Any]:
    """The values for the template: env.* gathered into `env` (None drops a variable)."""
    out = {k: v.value for k, v in values.items() if not k.startswith(ENV_PREFIX)}
    out["env"] = {
        k[len(ENV_PREFIX) :]: v.value for k, v in values.items() if k.startswith(ENV_PREFIX) and v.value is not None
    }
    return out
