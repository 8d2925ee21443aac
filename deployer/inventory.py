"""The inventory: one YAML file per host under hosts/ (or --inventory DIR), validated at load.

A file holds one host mapping, or `hosts: [ ... ]` for several. Errors name the file, the host
and the field. The built-in `local` host (this machine, no SSH) is always present unless a file
defines a host named `local`.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import InventoryError
from .locations import cache_dir, inventory_candidates, inventory_files

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+\Z")  # as patchset.release's, which this module does not import
ARCH_RE = re.compile(r"^sm_(\d+)(\d)([af]?)\Z")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SSHSpec(_Strict):
    host: str = Field(description="address or ssh_config alias")
    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity: str | None = None
    jump: str | None = Field(default=None, description="ProxyJump spec, e.g. user@bastion:22")
    config: str | None = Field(default=None, description="ssh_config file for this host")

    @field_validator("host", "user", "jump")
    @classmethod
    def _no_shell_or_option(cls, v: str | None) -> str | None:
        if v is not None and (not v or v.startswith("-") or any(c.isspace() for c in v)):
            raise ValueError(f"{v!r} must be non-empty, without spaces, and not start with '-'")
        return v

    @field_validator("port", mode="before")
    @classmethod
    def _port_not_bool(cls, v: object) -> object:
        return _no_bool(v)


def _no_bool(v: object) -> object:
    # YAML `true` would otherwise pass as the integer 1.
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is not a number")
    return v


class GPUSpec(_Strict):
    model: str
    count: int = Field(ge=1, le=64)
    arch: str = Field(description="CUDA arch, e.g. sm_120, sm_103")
    memory_gib: float | None = Field(default=None, gt=0, description="memory per GPU")

    @field_validator("count", mode="before")
    @classmethod
    def _count_not_bool(cls, v: object) -> object:
        return _no_bool(v)

    @field_validator("arch")
    @classmethod
    def _arch(cls, v: str) -> str:
        if not ARCH_RE.match(v):
            raise ValueError(f"{v!r} is not a CUDA arch like sm_120 or sm_103")
        return v

    @property
    def capability(self) -> tuple[int, int]:
        m = ARCH_RE.match(self.arch)
        return int(m.group(1)), int(m.group(2))


class RouterSpec(_Strict):
    """The SGLang router (Model Gateway) that sends this host's servers traffic: `rollout`
    deregisters each worker there before it drains it, and registers it again once it serves."""

    url: str = Field(description="the router's base URL, e.g. http://router.internal:30000")
    worker_url: str | None = Field(
        default=None,
        description="the worker's URL as the router knows it, with {port} for the unit's port "
        "(default http://<ssh.host>:{port})",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/]+(/\S*)?\Z", v):
            raise ValueError(f"{v!r} must be an http:// or https:// URL")
        return v.rstrip("/")

    @field_validator("worker_url")
    @classmethod
    def _worker_url(cls, v: str | None) -> str | None:
        if v is not None and (not re.match(r"^https?://\S+\Z", v) or "{port}" not in v):
            raise ValueError(f"{v!r} must be an http(s):// URL with {{port}} where the unit's port goes")
        return v


class Host(_Strict):
    name: str
    connection: Literal["ssh", "local"] = "ssh"
    ssh: SSHSpec | None = None
    gpu: GPUSpec
    interconnect: Literal["pcie", "nvlink"]
    checkout: str = Field(description="path of the SGLang checkout on the host")
    python: str = Field(default="python3", description="python of the host's environment")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for commands")
    groups: tuple[str, ...] = ()
    vars: dict[str, object] = Field(default_factory=dict, description="render values (launch scripts)")
    version: str | None = Field(
        default=None, description="pin: the ddtree release push and plan apply here when --version is not given"
    )
    router: RouterSpec | None = Field(default=None, description="the router in front of this host's servers")
    cpu_engine: bool = Field(
        default=False,
        description="serves the CPU engine profile (topology cpu-tiny): the built-in local host and "
        "test hosts only, never a GPU host",
    )
    source: str = Field(default="<builtin>", exclude=True)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} must be letters, digits, '_', '.', '-' (max 63)")
        return v

    @field_validator("checkout")
    @classmethod
    def _checkout(cls, v: str) -> str:
        # Quoted, a relative or ~ path would silently land under the login directory.
        if not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path (no ~ or relative paths)")
        if any(ord(c) < 32 or ord(c) == 127 for c in v):
            raise ValueError(f"{v!r} contains a newline or control character")
        return v

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for g in v:
            if not NAME_RE.match(g):
                raise ValueError(f"group {g!r} must be letters, digits, '_', '.', '-'")
        return v

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: object) -> object:
        if v is not None and not (isinstance(v, str) and VERSION_RE.match(v)):
            raise ValueError(f"{v!r} must be a released version such as 0.2.11 (quote it in YAML)")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\Z", key):
                raise ValueError(f"environment name {key!r} is not a valid variable name")
        return v

    @model_validator(mode="after")
    def _connection(self) -> "Host":
        if self.connection == "ssh" and self.ssh is None:
            raise ValueError("an ssh host needs an 'ssh' section (host, user, port, ...)")
        return self

    @property
    def is_local(self) -> bool:
        return self.connection == "local"

    def worker_url(self) -> str | None:
        """This host's worker URL template for its router ({port} left in), None without a router."""
        if self.router is None:
            return None
        if self.router.worker_url:
            return self.router.worker_url
        address = self.ssh.host if self.ssh else "127.0.0.1"
        address = f"[{address}]" if ":" in address else address
        return f"http://{address}:{{port}}"


def find_inventory_dir() -> Path:
    candidates = inventory_candidates()
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise NoInventoryError(
        f"no inventory: none of {', '.join(str(c) for c in candidates)} exists; pass "
        f"-i DIR or set DDEPLOY_HOSTS_DIR (a directory of host YAML files, docs/inventory.md)"
    )


class NoInventoryError(InventoryError):
    """No inventory directory was given and none of the places it is looked for exists."""


def local_host() -> Host:
    """The built-in host: this machine, checkout in the user's cache, made from the base on first use."""
    checkout = cache_dir() / "local" / "sglang"
    env = {"PYTHONPATH": str(checkout / "python"), "DDEPLOY_JIT_CACHE_ROOT": str(cache_dir() / "jit")}
    if os.environ.get("CUDA_HOME"):  # this machine's toolkit, as every CUDA build here would use it
        env["CUDA_HOME"] = os.environ["CUDA_HOME"]
    # This venv's python with the checkout first on its path: what `pip install -e` would give,
    # without touching the venv.
    return Host(
        name="local",
        connection="local",
        gpu=GPUSpec(model="local", count=1, arch=os.environ.get("DDEPLOY_LOCAL_ARCH", "sm_120")),
        interconnect="pcie",
        checkout=str(checkout),
        python=sys.executable,
        env=env,
        groups=("local",),
        cpu_engine=True,
    )


def parse_host(data: object, source: str, index: int | None = None) -> Host:
    where = source if index is None else f"{source}[{index}]"
    if not isinstance(data, dict):
        raise InventoryError(f"{where}: a host must be a mapping, got {type(data).__name__}")
    name = data.get("name", "?")
    try:
        return Host.model_validate({**data, "source": source})
    except ValidationError as exc:
        from .documents import field_error  # the one formatter; its module loads only for an error

        raise InventoryError(f"{where}: host '{name}': field {field_error(exc)}") from None


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when built with it
    """safe_load that refuses a repeated key (YAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may override keys
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_file(path: Path) -> list[Host]:
    try:
        doc = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark else ""
        raise InventoryError(f"{path}:{at} not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    except OSError as exc:
        raise InventoryError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise InventoryError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML") from None
    if doc is None:
        return []
    if isinstance(doc, dict) and set(doc) == {"hosts"}:
        if not isinstance(doc["hosts"], list):
            raise InventoryError(f"{path}: 'hosts' must be a list")
        return [parse_host(h, str(path), i) for i, h in enumerate(doc["hosts"])]
    return [parse_host(doc, str(path))]


class Inventory:
    def __init__(self, hosts: list[Host], directory: Path | None = None):
        self.directory = directory
        self.hosts: dict[str, Host] = {}
        for h in hosts:
            if h.name in self.hosts and self.hosts[h.name].source != "<builtin>":  # a file may replace `local` once
                raise InventoryError(f"{h.source}: host '{h.name}' is also defined in {self.hosts[h.name].source}")
            self.hosts[h.name] = h

    @classmethod
    def load(cls, directory: Path | str | None = None) -> "Inventory":
        """From `directory` (-i), else $DDEPLOY_HOSTS_DIR, else the first of ./hosts,
        <config>/ddeploy/hosts and the project checkout's hosts/ that exists (docs/inventory.md)."""
        directory = Path(directory or os.environ.get("DDEPLOY_HOSTS_DIR") or find_inventory_dir())
        if not directory.is_dir():
            raise InventoryError(f"inventory directory {directory} does not exist")
        hosts = [local_host()]
        for path in inventory_files(directory):
            hosts.extend(load_file(path))
        return cls(hosts, directory)

    @classmethod
    def builtin(cls) -> "Inventory":
        """Only the built-in `local` host (no inventory directory)."""
        return cls([local_host()], None)

    @property
    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for h in self.hosts.values():
            for g in h.groups:
                out.setdefault(g, []).append(h.name)
        return out

    def get(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            known = ", ".join(sorted(self.hosts))
            raise InventoryError(f"unknown host '{name}' (known: {known})") from None

    def select(
        self, names: tuple[str, ...] | list[str] = (), groups: tuple[str, ...] | list[str] = (), all_hosts: bool = False
    ) -> list[Host]:
        """Hosts by name, group or all (excluding `local` from --all); order kept, no duplicates."""
        if all_hosts:
            return [h for h in self.hosts.values() if not h.is_local]
        chosen: dict[str, Host] = {}
        for n in names:
            chosen[n] = self.get(n)
        for g in groups:
            members = self.groups.get(g)
            if not members:
                known = ", ".join(sorted(self.groups)) or "none"
                raise InventoryError(f"unknown or empty group '{g}' (known: {known})")
            for n in members:
                chosen[n] = self.hosts[n]
        return list(chosen.values())
