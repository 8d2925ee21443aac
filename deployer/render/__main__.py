"""`python -m deployer.render --update-golden`: regenerate tests/golden/ after a template change."""

from __future__ import annotations

import argparse

from .golden import update_golden


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deployer.render")
    parser.add_argument("--update-golden", action="store_true", help="rewrite tests/golden/ from the templates")
    args = parser.parse_args()
    if not args.update_golden:
        parser.error("nothing to do (pass --update-golden)")
    for path in update_golden():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
