"""`python -m deployer.agent OP` < request: the agent run from this checkout (the client ships it instead)."""

import sys

from .main import main

sys.exit(main(sys.argv))
