"""State shared by all commands: the inventory (loaded lazily) and output flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..inventory import Inventory


@dataclass
class AppContext:
    inventory_dir: str | None = None
    _inventory: Inventory | None = field(default=None, repr=False)

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = Inventory.load(Path(self.inventory_dir) if self.inventory_dir else None)
        return self._inventory
