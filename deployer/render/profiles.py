"""The render data: defaults, hardware profiles and topology profiles (YAML under templates/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import RenderError
from ..inventory import NAME_RE, Host
from ..locations import TEMPLATES_DIR


@dataclass(frozen=True)
class Topology:
    name: str
    description: str
    values: dict[str, Any]


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    arch: str
    interconnect: str
    tree_mask_backends: tuple[str, ...]
    unavailable_attention_backends: dict[str, str] = field(default_factory=dict)
    unavailable_a2a_backends: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Profiles:
    directory: Path
    defaults: dict[str, Any]
    hardware: dict[str, HardwareProfile]
    topologies: dict[str, Topology]

    def topology(self, name: str) -> Topology:
        try:
            return self.topologies[name]
        except KeyError:
            known = ", ".join(self.topologies)
            raise RenderError(f"unknown topology '{name}' (valid: {known})") from None

    def hardware_for(self, host: Host) -> HardwareProfile:
        for profile in self.hardware.values():
            if (profile.arch, profile.interconnect) == (host.gpu.arch, host.interconnect):
                return profile
        known = ", ".join(f"{p.name} ({p.arch}/{p.interconnect})" for p in self.hardware.values())
        raise RenderError(f"[{host.name}] no hardware profile for gpu.arch {host.gpu.arch} with interconnect "
                          f"{host.interconnect} (known: {known}); add one to {self.directory / 'hardware.yaml'}")


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RenderError(f"{path}: cannot read render profiles ({exc})") from None
    if not isinstance(doc, dict):
        raise RenderError(f"{path}: expected a mapping at the top level")
    return doc


def _hardware(name: str, raw: dict[str, Any], path: Path) -> HardwareProfile:
    try:
        return HardwareProfile(
            name=name, description=raw.get("description", ""), arch=raw["match"]["arch"],
            interconnect=raw["match"]["interconnect"], tree_mask_backends=tuple(raw["tree_mask_backends"]),
            unavailable_attention_backends=dict(raw.get("unavailable_attention_backends") or {}),
            unavailable_a2a_backends=dict(raw.get("unavailable_a2a_backends") or {}),
            values=dict(raw.get("values") or {}))
    except (KeyError, TypeError) as exc:
        raise RenderError(f"{path}: hardware profile '{name}' lacks {exc}") from None


def load_profiles(directory: Path | None = None) -> Profiles:
    """Read defaults.yaml, hardware.yaml and topologies.yaml from the templates directory."""
    directory = Path(directory or TEMPLATES_DIR)
    hardware = _read_mapping(directory / "hardware.yaml")
    topologies = _read_mapping(directory / "topologies.yaml")
    for name in topologies:  # names become file and directory names on hosts
        if not NAME_RE.match(str(name)):
            raise RenderError(f"{directory / 'topologies.yaml'}: topology name {name!r} must be letters, digits, "
                              "'_', '.', '-'")
    return Profiles(
        directory=directory,
        defaults=_read_mapping(directory / "defaults.yaml"),
        hardware={n: _hardware(n, raw, directory / "hardware.yaml") for n, raw in hardware.items()},
        topologies={n: Topology(n, raw.get("description", ""), dict(raw.get("values") or {}))
                    for n, raw in topologies.items()})
