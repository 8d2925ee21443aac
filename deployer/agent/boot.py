"""How the agent runs on a host from its compiled bundle: a meta path finder imports the package's
modules from their code objects (as zipimport would from a zip), then main runs.

BOOTSTRAP (deployer/transport/agent_client.py) loads the codes that the host keeps under the
bundle's hash, checking them, or has keep() compile the bundle the client sent; then it executes
this module's code and calls run(codes). Imported as deployer.agent.boot it only defines names.
"""

import os
import sys
from hashlib import sha256
from marshal import dumps

PACKAGE = "ddeploy_agent"  # the package's name on the host


class Bundle:
    """A meta path finder and loader for the agent's modules: {module name: code object}."""

    def __init__(self, codes):
        self.codes = codes

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.codes:
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(fullname, self, is_package=fullname == PACKAGE)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(self.codes[module.__spec__.name], module.__dict__)  # noqa: S102 - the agent's own code, checked by hash


def keep(path: str, digest: str, sources: dict) -> dict:
    """Compile the bundle; keep the codes at `path` (checksummed, written whole or not at all) and
    say so on stdout. The codes: {module name: code object}."""
    codes = {}
    for name, src in sources.items():
        codes[name] = compile(src, "<ddeploy-agent>/%s.py" % name.replace(".", "/"), "exec")
    data = dumps((digest, codes))
    tmp = "%s.%d.tmp" % (path, os.getpid())
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(sha256(data).digest() + data)
        os.replace(tmp, path)
        sys.stdout.write("ddeploy-agent kept %s\n" % digest)
    except OSError:  # an unwritable home only costs sending the bundle every time
        if os.path.exists(tmp):
            os.unlink(tmp)
    return codes


def run(codes):
    """Import the agent from `codes` and run its operation (argv: OP DIGEST); the request follows on stdin."""
    sys.meta_path.insert(0, Bundle(codes))
    main = __import__(PACKAGE + ".main", fromlist=["main"]).main
    sys.exit(main(sys.argv))
