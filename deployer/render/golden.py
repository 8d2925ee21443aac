"""Golden files: every shipped (host, topology) pair rendered, for tests/golden/ (review by eye).

`python -m deployer.render --update-golden` rewrites them; the tests compare byte for byte.
"""

from __future__ import annotations

from pathlib import Path

from ..inventory import Inventory
from ..paths import HOSTS_DIR, PROJECT_ROOT
from . import render_all

GOLDEN_DIR = PROJECT_ROOT / "tests" / "golden"
# (subdir, inventory, multi-node only): shipped hosts, and two-node groups from a test inventory.
SETS = (("shipped", HOSTS_DIR, False), ("multinode", GOLDEN_DIR / "inventory", True))


def golden_files() -> dict[str, str]:
    """Relative path under tests/golden/ -> expected content (scripts, env files, SKIPPED.txt)."""
    files: dict[str, str] = {}
    for sub, inventory_dir, multi in SETS:
        units, skipped = render_all(Inventory.load(inventory_dir), multi_node_only=multi)
        for unit in units:
            files[f"{sub}/{unit.script_file}"] = unit.script
            files[f"{sub}/{unit.env_file}"] = unit.env
        files[f"{sub}/SKIPPED.txt"] = "".join(f"{label}: {reason}\n" for label, reason in skipped)
    return files


def update_golden(root: Path = GOLDEN_DIR) -> list[Path]:
    """Rewrite the golden scripts/env files (stale ones removed); return what was written."""
    expected = golden_files()
    for sub, _, _ in SETS:
        for old in (root / sub).glob("*"):
            if old.is_file() and f"{sub}/{old.name}" not in expected:
                old.unlink()
    written = []
    for rel, text in sorted(expected.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755 if rel.endswith(".sh") else 0o644)
        written.append(path)
    return written
