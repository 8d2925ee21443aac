"""Where things live: the project's data directories and the user's cache."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(os.environ.get("DDEPLOY_PROJECT_ROOT", Path(__file__).resolve().parent.parent))
PATCHES_DIR = PROJECT_ROOT / "patches"
OVERLAYS_DIR = PROJECT_ROOT / "overlays"
HOSTS_DIR = PROJECT_ROOT / "hosts"
TEMPLATES_DIR = PROJECT_ROOT / "templates"

PATCH_SET_NAME = "ddtree"


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
    """The overlay commands work on: $DDEPLOY_OVERLAY_DIR, else the project's overlays/ddtree."""
    return Path(os.environ.get("DDEPLOY_OVERLAY_DIR") or overlay_dir())


def patch_set_root(name: str = PATCH_SET_NAME) -> Path:
    return PATCHES_DIR / name
