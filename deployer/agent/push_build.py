"""`ddeploy push --build` as one operation: the push, then the kernel build it calls for, under one
hold of the checkout's lock, so no other command can change the checkout between the two."""

import contextlib

from .build import run_build
from .build_plan import kernel_source_hash
from .common import Fail, progress, silenced, test_pause
from .lock import acquire, release
from .patch_files import Scratch, load_patches
from .push import need_checkout, push_held
from .repo import Repo


def op_push_build(repo: Repo, req: dict) -> dict:
    """req: a push's request plus `build` {target, options} (a build's request). The build runs
    only when the push changed the kernel sources; otherwise an existing build is made current."""
    need_checkout(repo)
    with Scratch("ddeploy-push-") as workdir:
        patches = load_patches(req, workdir)  # NeedShip before the lock, as a push
        acquire(repo, req)
        try:
            before = kernel_source_hash(repo.path)
            pushed = push_held(repo, req, patches)
            if not pushed["changed"]:
                return {"ok": True, "push": pushed, "build": None, "kernel_sources_changed": False}
            test_pause(req, "before_build")
            return dict(build_after_push(repo, dict(req, **req["build"]), before), ok=True, push=pushed)
        finally:
            release(repo)


def build_after_push(repo: Repo, req: dict, before) -> dict:
    after = kernel_source_hash(repo.path)
    if after is not None and after != before:
        return {"build": run_build(repo, req, contextlib.nullcontext), "kernel_sources_changed": True}
    progress("kernel sources unchanged by this push; no build")
    return {"build": None, "note": reuse_build(repo, req) if after is not None else None}


def reuse_build(repo: Repo, req: dict):
    """The existing build (if any) now serves the new version too; never compiles. A note when
    there is none usable: the push itself succeeded, and the next `ddeploy build` says more."""
    reuse = dict(req, options=dict(req.get("options", {}), reuse_only=True))
    try:
        with silenced():
            run_build(repo, reuse, contextlib.nullcontext)
    except Fail as exc:
        if exc.kind != "BuildError":
            raise
        note = "no usable kernel build for this version yet (%s)" % exc
        progress("note: %s" % note)
        return note
    return None
