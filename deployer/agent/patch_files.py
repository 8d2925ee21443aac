"""The set's patches as files on the host: written from the request (a first push, a plan) or
read from the set shipped before and checked against their sha256."""

import hashlib
import os

from .common import Fail


class Scratch:
    """A temporary directory made on first use of .path (a push whose set has its own dir needs
    none), removed at the end of the with block."""

    def __init__(self, prefix: str):
        self.prefix, self._path = prefix, None

    @property
    def path(self) -> str:
        if self._path is None:
            import tempfile

            self._path = tempfile.mkdtemp(prefix=self.prefix)
        return self._path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._path is not None:
            import shutil

            shutil.rmtree(self._path, ignore_errors=True)


def load_patches(req: dict, workdir: Scratch) -> list:
    """Write/verify the set's patches as files; returns [(name, path, sha256, files)]."""
    spec = req["set"]
    out = []
    for p in spec["patches"]:
        if "/" in p["name"] or p["name"].startswith("."):
            raise Fail("PatchSetError", "patch name %r is not a plain file name" % p["name"])
        if "data_b64" in p:
            import base64

            data = base64.b64decode(p["data_b64"])
            path = os.path.join(spec.get("dir") or workdir.path, p["name"])
            if spec.get("dir"):
                os.makedirs(spec["dir"], exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(data)
        else:
            path = os.path.join(spec["dir"], p["name"])
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                raise Fail("NeedShip", "patch set not on the host yet") from None
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise Fail("NeedShip", "patch %s on the host differs; ship it again" % p["name"])
        if hashlib.sha256(data).hexdigest() != p["sha256"]:
            raise Fail(
                "ChecksumError", "patch %s arrived corrupted on the host (sha256 mismatch); push again" % p["name"]
            )
        out.append((p["name"], path, p["sha256"], p["files"]))
    return out
