"""`ddeploy build`: the kernels compiled in place for each host's GPU (deployer.ops.kernel_build)."""

from __future__ import annotations

import click

from .app import cli
from .context import fleet_options, selection
from .fleet import run


@cli.command()
@fleet_options
@click.option("--force", is_flag=True, help="Rebuild even when the cache already has this build.")
@click.pass_context
def build(ctx, force):
    """Compile the DDTree JIT kernels on the hosts, for each host's GPU arch."""
    from ..ops.kernel_build import BuildOptions, build_host

    opts = BuildOptions(force=force, accept_new_host_keys=selection(ctx).accept_new_host_keys, command=ctx.obj.command)
    run(ctx.obj, selection(ctx), lambda h, say: build_host(h, opts, say), _views().describe_build)


def _views():
    """The renderers, imported when a command runs (not for --help or --version)."""
    from . import views

    return views
