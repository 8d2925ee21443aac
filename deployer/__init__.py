"""ddeploy: ship DDTree speculative-decoding patch sets onto SGLang checkouts on GPU hosts."""

__version__ = "0.1.0"
