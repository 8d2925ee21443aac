"""`ddeploy` commands: render (filled in by its issue)."""

from __future__ import annotations
