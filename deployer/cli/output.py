"""Human output goes to stderr (prefixed `[host]`), machine output (`--json`) to stdout."""

from __future__ import annotations

import json
from typing import Any

import click


def say(message: str, host: str | None = None, *, err: bool = True) -> None:
    prefix = f"[{host}] " if host else ""
    click.echo(f"{prefix}{message}", err=err)


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def table(rows: list[list[str]], headers: list[str]) -> str:
    """A plain aligned text table (no colours: it is also read in CI logs)."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])
