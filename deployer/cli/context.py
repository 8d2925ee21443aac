"""State shared by all commands: the command line as typed, the inventory (loaded lazily) and the
host selection of fleet commands (one frozen Selection, filled in by the `fleet_options` decorator)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import UsageError

if TYPE_CHECKING:
    from ..inventory import Host, Inventory


@dataclass
class AppContext:
    argv: tuple[str, ...] = ()
    inventory_dir: str | None = None
    _inventory: "Inventory | None" = field(default=None, repr=False)

    @property
    def command(self) -> str:
        """The real command line (recorded in the host's lock owner and journal)."""
        return shlex.join(["ddeploy", *self.argv])

    @property
    def inventory(self) -> "Inventory":
        if self._inventory is None:
            from ..inventory import Inventory

            self._inventory = Inventory.load(Path(self.inventory_dir) if self.inventory_dir else None)
        return self._inventory


@dataclass(frozen=True)
class Selection:
    """Which hosts a fleet command works on, and how."""

    names: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    all_hosts: bool = False
    parallel: int = 8
    fail_fast: bool = False
    as_json: bool = False
    accept_new_host_keys: bool = False

    @property
    def given(self) -> bool:
        return bool(self.names or self.groups or self.all_hosts)

    def hosts(self, app: AppContext) -> list["Host"]:
        if not self.given:
            raise UsageError("choose hosts with --host NAME, --group G or --all (see `ddeploy hosts`)")
        if self.all_hosts and (self.names or self.groups):
            raise UsageError("--all already selects every host; drop --host/--group (or drop --all)")
        return app.inventory.select(self.names, self.groups, self.all_hosts)


_SELECTION_KEYS = ("names", "groups", "all_hosts", "parallel", "fail_fast", "as_json", "accept_new_host_keys")


def _store(ctx: click.Context, param: click.Parameter, value):
    ctx.meta.setdefault("ddeploy.selection", {})[param.name] = tuple(value) if isinstance(value, list) else value
    return value


def fleet_options(fn):
    """--host/--group/--all plus --parallel/--fail-fast/--json/--accept-new-host-keys, gathered
    into one Selection (`selection(ctx)`) instead of seven parameters on every command."""
    opts = [
        click.option("--host", "-H", "names", multiple=True, help="Host name (repeatable)."),
        click.option("--group", "-g", "groups", multiple=True, help="All hosts of a group (repeatable)."),
        click.option("--all", "all_hosts", is_flag=True, help="Every inventory host (not `local`)."),
        click.option(
            "--parallel",
            "-j",
            type=click.IntRange(1, 256),
            default=8,
            show_default=True,
            help="Hosts worked on at once.",
        ),
        click.option("--fail-fast", is_flag=True, help="Start no new host after a failure."),
        click.option("--json", "as_json", is_flag=True, help="Per-host results as JSON on stdout."),
        click.option(
            "--accept-new-host-keys",
            is_flag=True,
            help="Record unknown SSH host keys in known_hosts (changed keys are still refused).",
        ),
    ]
    for opt in reversed(opts):
        opt(fn)
    for param in fn.__click_params__[-len(opts) :]:
        param.expose_value, param.callback = False, _store
    return fn


def selection(ctx: click.Context) -> Selection:
    raw = ctx.meta.get("ddeploy.selection", {})
    return Selection(**{k: raw[k] for k in _SELECTION_KEYS if k in raw})


def overlay_option(fn):
    """`--overlay [DIR]`: a dev snapshot of the overlay's working copy instead of a release (DIR
    defaults to $DDEPLOY_OVERLAY_DIR, else the checkout's overlays/ddtree)."""
    return click.option(
        "--overlay",
        "overlay",
        is_flag=False,
        flag_value="",
        default=None,
        metavar="[DIR]",
        help="Use a dev snapshot of the overlay's working copy (DIR, default: the active overlay), not a release.",
    )(fn)


def chosen_set(version: str | None, overlay: str | None):
    """The patch set a command works with: a release (`--version`, default latest) or, with
    --overlay, the overlay's dev snapshot (exported once per content, kept in the cache)."""
    from ..patchset import load_patch_set

    if overlay is None:
        return load_patch_set(version)
    if version is not None:
        raise UsageError("--overlay uses a dev snapshot of the overlay; drop --version (or drop --overlay)")
    from ..locations import active_overlay_dir
    from ..patchset.snapshot import dev_snapshot
    from .output import say

    path = Path(overlay) if overlay else active_overlay_dir()
    ps = dev_snapshot(path)
    say(f"dev snapshot {ps.name} {ps.version} of {path} ({len(ps.patches)} patches, {ps.path})")
    return ps
