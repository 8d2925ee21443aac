"""What a per-host operation returns: its typed result and whether it changed the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Say = Callable[[str], None]


@dataclass(frozen=True)
class Outcome:
    result: Any  # a pydantic model (deployer.remote.protocol or one of the ops' own)
    changed: bool = False

    def to_data(self) -> dict[str, Any]:
        """The result as JSON-ready data (stable field names, no display strings)."""
        if self.result is None:
            return {}
        dump = getattr(self.result, "to_data", None) or self.result.model_dump
        return dump()
