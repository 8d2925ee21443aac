"""Package data that lives beside the package in the checkout (templates, released patch sets,
example hosts) installs under <prefix>/share/ddeploy/, where deployer/locations.py finds it in a
non-editable install. Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
DATA_TREES = ("templates", "patches", "hosts")


def data_files() -> list[tuple[str, list[str]]]:
    out: dict[str, list[str]] = {}
    for top in DATA_TREES:
        for path in sorted((HERE / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                rel = path.relative_to(HERE)
                out.setdefault(str(Path("share/ddeploy") / rel.parent), []).append(str(rel))
    return sorted(out.items())


setup(data_files=data_files())
