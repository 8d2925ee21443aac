"""Golden files: every shipped (host, topology) pair rendered, for tests/golden/ (review by eye).

`python tests/golden_files.py --update-golden` rewrites them; tests/test_render.py compares them
byte for byte. Test tooling: it is not part of the installed package.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deployer.inventory import Inventory
from deployer.render import render_all

PROJECT = Path(__file__).resolve().parent.parent
HOSTS_DIR = PROJECT / "hosts"
GOLDEN_DIR = PROJECT / "tests" / "golden"
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tests/golden_files.py")
    parser.add_argument("--update-golden", action="store_true", help="rewrite tests/golden/ from the templates")
    args = parser.parse_args()
    if not args.update_golden:
        parser.error("nothing to do (pass --update-golden)")
    for path in update_golden():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
