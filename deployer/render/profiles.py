"""The render data: defaults, hardware profiles and topology profiles (YAML under templates/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..documents import DefaultsDoc, HardwareDoc, HardwareProfileDoc, TopologiesDoc, load_document
from ..errors import RenderError
from ..inventory import Host
from ..locations import TEMPLATES_DIR


@dataclass(frozen=True)
class Topology:
    name: str
    description: str
    values: dict[str, Any]
    cpu_engine: bool = False  # SGLang on CPU with the overlay's test harness (hosts with cpu_engine)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    arch: str
    interconnect: str
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
        raise RenderError(
            f"no hardware profile for gpu.arch {host.gpu.arch} with interconnect "
            f"{host.interconnect} (known: {known}); add one to {self.directory / 'hardware.yaml'}",
            host=host.name,
        )


def _document(path: Path, model):
    return load_document(path, model, RenderError, "render profile")


def _hardware(name: str, doc: HardwareProfileDoc) -> HardwareProfile:
    return HardwareProfile(
        name=name,
        description=doc.description,
        arch=doc.match.arch,
        interconnect=doc.match.interconnect,
        unavailable_attention_backends=dict(doc.unavailable_attention_backends),
        unavailable_a2a_backends=dict(doc.unavailable_a2a_backends),
        values=dict(doc.values),
    )


def load_profiles(directory: Path | None = None) -> Profiles:
    """Read defaults.yaml, hardware.yaml and topologies.yaml from the templates directory
    (each validated by its model in deployer.documents)."""
    directory = Path(directory or TEMPLATES_DIR)
    hardware = _document(directory / "hardware.yaml", HardwareDoc).root
    topologies = _document(directory / "topologies.yaml", TopologiesDoc).root
    return Profiles(
        directory=directory,
        defaults=_document(directory / "defaults.yaml", DefaultsDoc).root,
        hardware={n: _hardware(n, doc) for n, doc in hardware.items()},
        topologies={n: Topology(n, doc.description, dict(doc.values), doc.cpu_engine) for n, doc in topologies.items()},
    )
