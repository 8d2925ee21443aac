"""`ddeploy` commands: remote (filled in by its issue)."""

from __future__ import annotations
