"""`ddeploy launch | logs | stop`: rendered launch scripts started, tailed and stopped on hosts
(deployer.ops.launch; one connection per host per command)."""

from __future__ import annotations

import sys

import click

from .app import cli
from .context import AppContext
from .output import say
from .render import host_options, set_option


def wait_timeout_option(help_text: str):
    return click.option(
        "--wait-timeout", default=900.0, show_default=True, type=click.FloatRange(min=1), help=help_text
    )


@cli.command()
@host_options
@click.option("--topology", "-t", required=True, help="Topology profile (templates/topologies.yaml).")
@set_option
@click.option("--dry-run", is_flag=True, help="Render and show what would be copied and started; touch nothing.")
@click.option(
    "--wait",
    "wait",
    is_flag=True,
    help="Wait until every unit serves (the agent polls /health on the host) and report what it serves.",
)
@wait_timeout_option("Seconds --wait allows; a launch not healthy by then is stopped.")
@click.pass_obj
def launch(app: AppContext, hosts, group, topology, sets, dry_run, wait, wait_timeout) -> None:
    """Render, copy the script(s) to the host and start them detached (log + pid recorded there)."""
    from ..ops import launch as lc

    chosen = app.inventory.select(names=hosts, groups=(group,) if group else ())
    started = lc.launch(
        chosen, topology, sets, say, dry_run=dry_run, command=app.command, wait=wait_timeout if wait else None
    )
    for name, reply in started.items():
        for s in getattr(reply, "serving", None) or []:
            say(f"{s.unit} serves {describe_serving(s)}", name)
    if dry_run:
        for name, units in started.items():
            remote = f"{lc.launch_dir(units)}/{topology}"
            for u in units:
                say(
                    f"would copy {u.script_file} + {u.env_file} to {remote}/ and start it detached, "
                    f"log {remote}/{u.name}.log",
                    name,
                )


def describe_serving(s) -> str:
    """One line: model, speculation (what verify width), attention backend, TP."""
    if s.config == "ddtree":
        spec = f"DFLASH + DDTree (budget {s.tree_budget}, top-K {s.tree_topk}, verify width {s.verify_width})"
    elif s.config == "linear":
        spec = f"linear DFLASH (verify width {s.verify_width})"
    elif s.config == "plain":
        spec = "no speculative decoding"
    else:
        spec = f"{s.speculative_algorithm} (verify width {s.verify_width})"
    parallel = f"TP {s.tp_size}" + (f", EP {s.ep_size}" if s.ep_size and s.ep_size > 1 else "")
    return f"{s.model}: {spec}, attention {s.attention_backend}, {parallel} (SGLang {s.version}, {s.url})"


@cli.command()
@click.option("--host", required=True, help="Host whose last launch to show.")
@click.option("-n", "lines", default=50, show_default=True, help="Lines from the end of each log.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines (Ctrl-C ends).")
@set_option
@click.pass_obj
def logs(app: AppContext, host, lines, follow, sets) -> None:
    """Tail the log(s) of the last launch on a host."""
    from ..ops import launch as lc

    lc.logs(app.inventory.get(host), sets, lines, follow, click.echo)


@cli.command()
@click.option("--host", required=True, help="Host whose launched server to stop.")
@click.option("--grace", default=30.0, show_default=True, help="Seconds between TERM and KILL.")
@set_option
@click.pass_obj
def stop(app: AppContext, host, grace, sets) -> None:
    """Stop exactly the processes the last launch started (TERM, wait, KILL)."""
    from ..ops import launch as lc

    lc.stop(app.inventory.get(host), sets, lambda m: say(m, host), grace)


@cli.command()
@click.option("--host", required=True, help="Host whose serving launch to measure.")
@click.option("--topology", "-t", help="Fail unless the host serves this topology (default: what it serves).")
@click.option(
    "--compare",
    type=click.Choice(["linear", "plain"]),
    help="Also measure the same launch without the tree (linear DFlash) or without speculation; restarts the server.",
)
@click.option("--requests", "-n", default=128, show_default=True, type=int, help="Prompts per concurrency.")
@click.option(
    "--concurrency", "-c", multiple=True, type=int, help="Concurrent requests; repeat for a sweep.  [default: 1, 16]"
)
@click.option("--input-len", default=1024, show_default=True, type=int, help="Tokens per random prompt.")
@click.option("--output-len", default=256, show_default=True, type=int, help="Tokens generated per request.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0: greedy (and the greedy check).")
@click.option("--seed", default=1, show_default=True, type=int, help="Seed of the prompts.")
@click.option(
    "--warmup",
    default=1,
    show_default=True,
    type=int,
    help="Client runs at the first concurrency before each config's measured runs; their results are discarded.",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=int,
    help="Client runs per concurrency and config; the table shows their medians, the speedup an interval.",
)
@wait_timeout_option("Seconds a server may take to serve (the baseline's and the restart's too).")
@click.option(
    "--run-timeout",
    default=3600.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds one run of the benchmark client (warm-up or measured) may take; then it is stopped on the host.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    help="Seconds the whole benchmark may take on the host (client runs, greedy probes, the baseline's start); "
    "past it the run is stopped, the launch serves again as before, and bench fails.  [default: every run, "
    "warm-up and repeats, at --run-timeout + 600 s of probes per config, + --wait-timeout with --compare]",
)
@click.option("--yes", "-y", is_flag=True, help="Restart a running server for --compare without asking.")
@click.option("--json", "as_json", is_flag=True, help="The result as JSON on stdout (docs/json.md).")
@set_option
@click.pass_obj
def bench(app: AppContext, host, topology, compare, requests, concurrency, input_len, output_len, temperature,
          seed, warmup, repeats, wait_timeout, run_timeout, timeout, yes, as_json, sets) -> None:  # fmt: skip
    """Measure the launched server with SGLang's benchmark client, run on the host: tokens/s, TTFT,
    ITL, accept length per concurrency (medians of --repeats runs after --warmup); --compare adds
    the baseline, the speedup with its interval, and the greedy check."""
    from ..ops import bench as bc
    from ..render import launch_dir_for

    params = bc.BenchParams(
        requests, tuple(concurrency) or (1, 16), input_len, output_len, temperature, seed, wait_timeout, run_timeout,
        timeout, warmup=warmup, repeats=repeats,
    )  # fmt: skip
    target = app.inventory.get(host)
    if compare and not yes and sys.stdin.isatty():
        yes = click.confirm(f"--compare restarts the server running on {host}; go ahead?", err=True)
    try:
        result = bc.bench(
            target,
            launch_dir_for(target, sets),
            params,
            lambda m: say(m, host),
            topology=topology,
            compare=compare,
            yes=yes,
            command=app.command,
        )
    except bc.GreedyMismatchError as exc:
        _show_bench(exc.data, as_json)
        raise
    _show_bench(result, as_json)


def _show_bench(result: dict, as_json: bool) -> None:
    from .output import emit_json
    from .views import bench_table

    if as_json:
        emit_json(bench_json(result))
    else:
        click.echo(bench_table(result))


def bench_json(result: dict) -> dict:
    """The stable fields (docs/json.md); server args stay in the host's bench.jsonl."""
    return {k: v for k, v in result.items() if k != "server_args"}
