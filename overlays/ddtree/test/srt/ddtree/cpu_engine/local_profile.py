"""Prepare what the ``cpu-tiny`` launch profile serves: a CPU copy of a checkout
and tiny models (test-only; the deploy tool's ``local`` host runs it).

    PYTHONPATH=<checkout>/test/srt/ddtree python -m cpu_engine.local_profile \\
        --checkout <checkout> --dest <dir> [--arch mla|llama] [--kind alternating]

writes, replacing what an earlier run left there::

    <dir>/cpu-tree/python/           the checkout's python/ with the CPU changes
    <dir>/cpu-tree/sgl_kernel_stub/  the sgl_kernel stand-in
    <dir>/models/target, .../draft   tiny checkpoints with a WordLevel tokenizer

The rendered ``cpu-tiny`` script runs this before ``sglang.launch_server``, so a
server always serves the checkout as it is now (a push since the last launch
included). ``cpu-tree`` and ``models`` are links into the artefact cache
(``cache``): the CPU tree, byte-compiled, is built once per content of the
checkout's ``sglang/`` (and the harness), so a start whose checkout is unchanged
copies and compiles nothing. The links are made in ``<dir>.new`` and renamed into
place, so a failed run leaves the previous ones whole.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from .cpu_tree import cached_cpu_tree
from .models import ARCHS, KINDS, cached_tiny_models


def prepare(checkout: Path, dest: Path, arch: str, kind: str) -> Path:
    """Link the CPU tree and the models under ``dest``; returns ``dest``."""
    source = Path(checkout) / "python"
    tree_python = cached_cpu_tree((source / "sglang",), lambda work: source)
    models = cached_tiny_models(arch=arch, kind=kind)
    staging = dest.with_name(dest.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "cpu-tree").symlink_to(tree_python.parent)
    (staging / "models").symlink_to(models.target.parent)
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, required=True)
    parser.add_argument("--dest", type=Path, required=True)
    parser.add_argument("--arch", choices=ARCHS, default="mla")
    parser.add_argument("--kind", choices=KINDS, default="alternating")
    args = parser.parse_args(argv)
    dest = prepare(args.checkout, args.dest.resolve(), args.arch, args.kind)
    print(f"cpu engine profile: {args.arch} {args.kind} models and the CPU tree "
          f"of {args.checkout} in {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
