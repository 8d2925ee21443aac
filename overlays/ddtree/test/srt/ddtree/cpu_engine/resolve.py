"""Resolve server arguments the way ``sglang.launch_server`` does, many at once.

A refusal of DDTree's happens while a server's arguments resolve, before the
server starts a scheduler or loads a weight: ``sglang.launch_server`` loads the
plugins, calls ``prepare_server_args(argv)`` and, in ``run_server``,
``ServerArgs.resolve_once()``, where SGLang's resolution hooks (DFlash's among
them, and DDTree's through it) raise. :func:`resolve_many` runs exactly those
calls for each argument list in one child process of the tree under test, with
a server's environment, and returns what each raised: one interpreter start
(about 10 s of imports on CPU) instead of one server process per refusal.

A fresh ``ServerArgs`` per argument list: a failed resolution marks only its own
record. ``test_ddtree_engine_refusals`` keeps one refusal as a real
``sglang.launch_server`` start, which shows the exit and the log a user sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from .server import BASE_ARGS, server_env

# The child: reads {name: argv} as JSON on stdin, writes {name: outcome} as JSON
# on its last stdout line; an outcome is {"refused": "<Type>: <message>"} or
# {"resolved": {field: value}} for the fields a test may read.
_CHILD = """
import json, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args

load_plugins()
FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens",
          "speculative_dflash_tree_budget", "speculative_dflash_tree_topk")
out = {}
for name, argv in json.load(sys.stdin).items():
    try:
        server_args = prepare_server_args(argv)
        server_args.resolve_once()
    except Exception as e:
        out[name] = {"refused": f"{type(e).__name__}: {e}"}
    else:
        fields = server_args.resolved_dict()
        out[name] = {"resolved": {f: fields.get(f) for f in FIELDS}}
print(json.dumps(out))
"""


def resolve_many(
    python_dir: Path,
    cases: Mapping[str, tuple[Path, Sequence[str]]],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 400,
) -> dict[str, dict]:
    """Each case's outcome (see ``_CHILD``) for ``{name: (model, args)}``, whose
    arguments come after :data:`BASE_ARGS` as a server's do. The child's output
    goes to ``log_path``."""
    argvs = {
        name: ["--model-path", str(model), *BASE_ARGS, "--port", "30000",
               *[str(a) for a in args]]
        for name, (model, args) in cases.items()
    }
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as cwd:  # nothing importable beside it
        child = subprocess.run(
            [sys.executable, "-c", _CHILD], input=json.dumps(argvs), text=True,
            capture_output=True, cwd=cwd, env=server_env(python_dir, env),
            timeout=timeout,
        )
    log_path.write_text(f"$ resolve {json.dumps(argvs)}\n{child.stderr}{child.stdout}")
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        raise RuntimeError(
            f"the resolving child exited with code {child.returncode} "
            f"(log: {log_path}):\n{child.stderr[-3000:]}")
    return json.loads(lines[-1])
