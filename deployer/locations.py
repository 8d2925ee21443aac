"""Where things live: the tool's data (templates, released patch sets, example hosts), the
inventory, the overlay and the user's cache.

Data comes from the source checkout when ddeploy runs from one (an editable install, or
$DDEPLOY_PROJECT_ROOT), else from <prefix>/share/ddeploy/ where `pip install .` puts it (setup.py).
The inventory is the first of: `-i DIR`, $DDEPLOY_HOSTS_DIR, ./hosts, <config>/ddeploy/hosts
($XDG_CONFIG_HOME, else ~/.config), the checkout's hosts/. The overlay is `--overlay DIR`,
$DDEPLOY_OVERLAY_DIR, else the checkout's overlays/ddtree (an installed ddeploy has none).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PATCH_SET_NAME = "ddtree"
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent


def project_checkout() -> Path | None:
    """The source checkout ddeploy runs from, or None for an installed (non-editable) ddeploy."""
    root = Path(os.environ.get("DDEPLOY_PROJECT_ROOT") or _PACKAGE_PARENT)
    return root if (root / "templates").is_dir() and (root / "deployer").is_dir() else None


def data_root() -> Path:
    """templates/, patches/ and hosts/ as shipped: the checkout, else the install's share/ddeploy."""
    return project_checkout() or Path(sys.prefix) / "share" / "ddeploy"


PROJECT_ROOT = data_root()
TEMPLATES_DIR = PROJECT_ROOT / "templates"
PATCHES_DIR = PROJECT_ROOT / "patches"
HOSTS_DIR = PROJECT_ROOT / "hosts"  # the shipped example hosts
OVERLAYS_DIR = PROJECT_ROOT / "overlays"


def config_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "ddeploy"


def inventory_candidates() -> list[Path]:
    """Where the inventory is looked for when neither -i nor $DDEPLOY_HOSTS_DIR names one, in order."""
    found = [Path.cwd() / "hosts", config_dir() / "hosts"]
    checkout = project_checkout()
    return found + ([checkout / "hosts"] if checkout else [])


def inventory_files(directory: Path) -> list[Path]:
    """The host files of an inventory directory, in the order they are read: *.yaml and *.yml,
    except those whose name starts with `_`."""
    return [p for p in sorted(directory.glob("*.y*ml")) if p.suffix in (".yaml", ".yml") and not p.name.startswith("_")]


def cache_dir() -> Path:
    """The user's cache for ddeploy: $DDEPLOY_CACHE_DIR, else $XDG_CACHE_HOME/ddeploy, else ~/.cache/ddeploy."""
    explicit = os.environ.get("DDEPLOY_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "ddeploy"


def overlay_dir(name: str = PATCH_SET_NAME) -> Path:
    return OVERLAYS_DIR / name


def active_overlay_dir() -> Path:
    """The overlay commands work on: $DDEPLOY_OVERLAY_DIR, else the project checkout's overlays/ddtree."""
    explicit = os.environ.get("DDEPLOY_OVERLAY_DIR")
    if explicit:
        return Path(explicit)
    if project_checkout() is None:
        from .errors import UsageError

        raise UsageError(
            "no overlay: this ddeploy is installed without its project checkout; pass --overlay DIR "
            "or set DDEPLOY_OVERLAY_DIR"
        )
    return overlay_dir()


def patch_set_root(name: str = PATCH_SET_NAME) -> Path:
    return PATCHES_DIR / name
