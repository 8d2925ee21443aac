"""Jinja2 rendering with StrictUndefined and shell quoting: a missing value is an error naming it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import jinja2

from ..errors import RenderError

SCRIPT_TEMPLATE = "launch.sh.j2"
ENV_TEMPLATE = "launch.env.j2"


def shquote(value: Any) -> str:
    """One shell word; booleans as true/false so a script never sees Python's True."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    if value is None or isinstance(value, (list, dict)):
        raise RenderError(f"cannot shell-quote {value!r} as one word (a list needs the shjoin filter)")
    return shlex.quote(str(value))


def shjoin(values: Any) -> str:
    if not isinstance(values, (list, tuple)) or not values:
        raise RenderError(f"expected a non-empty command list, got {values!r}")
    return " ".join(shquote(v) for v in values)


def environment(directory: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - shell scripts, not HTML: values are shell-quoted by the filters
    )
    env.filters["shquote"] = shquote
    env.filters["shjoin"] = shjoin
    return env


def render_template(env: jinja2.Environment, name: str, context: dict[str, Any]) -> str:
    try:
        return env.get_template(name).render(**context)
    except jinja2.UndefinedError as exc:
        match = re.search(r"'([^']+)' is undefined|has no attribute '([^']+)'", str(exc))
        missing = next((g for g in (match.groups() if match else ()) if g), str(exc))
        raise RenderError(
            f"templates/{name}: value '{missing}' is undefined; define it in templates/defaults.yaml "
            f"or pass --set {missing}=..."
        ) from None
    except jinja2.TemplateError as exc:
        where = f"templates/{name}" + (f":{exc.lineno}" if getattr(exc, "lineno", None) else "")
        raise RenderError(f"{where}: {exc}") from None
