"""Start, tail and stop rendered launch scripts on hosts; the agent owns the records there.

Layout on the host (launch_dir is a render value, default `<checkout>/../ddeploy-launch`):
    <launch_dir>/<topology>/<unit>.sh, <unit>.env, <unit>.log
    ~/.cache/ddeploy/launches/launch.json, launch.lock   the host's last launch (topology, scripts
        dir, units: pid, start time, log; state) and its lock, whatever launch_dir it used
Each unit starts detached in its own session. Stop checks the recorded start time (/proc/<pid>/stat
field 22) before signalling, so a reused pid is never hit, then sends TERM to every process of the
session (also when its leader is gone), waits, and KILLs what is left. One connection per host per
command.
"""

from __future__ import annotations

import os

from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import ExitStack
from typing import Any, Callable

from ..errors import DeployError, RenderError, StateError
from ..inventory import Host
from ..transport.agent_client import AgentSession, agent_session
from ..transport.protocol import HostState, StateReply
from ..transport.protocol_serving import LaunchReply, LogsReply, StopReply, WaitReply
from ..render import RenderedUnit, launch_dir_for, render_hosts

HostSay = Callable[[str, str], None]  # (message, host)


def build_cache_dir(state: HostState | dict[str, Any], arch: str) -> tuple[str | None, str]:
    """The JIT cache of a good build of the applied version for `arch`, or (None, why not)."""
    state = state if isinstance(state, HostState) else HostState.model_validate(state)
    if state.applied is None:
        return None, "no patch set applied"
    applied = state.applied.version
    build = state.builds.get(arch)
    if build is None:
        return None, f"no kernel build recorded for {arch}"
    candidates = ([build] if build.ok else []) + list(build.known.values())
    for cand in candidates:
        if cand.cache_dir and cand.version == applied:
            return cand.cache_dir, f"build record {arch}, {cand.at or '?'}"
    return None, f"no good kernel build of the applied version {applied} for {arch}"


def probed_values(agents: dict[str, AgentSession], say: HostSay) -> dict[str, tuple[dict, str]]:
    """Per host, render values read from the host: jit_cache_dir from its kernel build record."""
    probed = {}
    for name, agent in agents.items():
        state = agent.call("state", {}, StateReply).state
        cache_dir, why = build_cache_dir(state, agent.host.gpu.arch)
        if cache_dir:
            probed[name] = ({"jit_cache_dir": cache_dir}, f"host {name} {why}")
        else:
            say(f"{why}: JIT kernels will compile at first use (run `ddeploy build --host {name}`)", name)
    return probed


def by_host(units: list[RenderedUnit]) -> dict[str, list[RenderedUnit]]:
    out: dict[str, list[RenderedUnit]] = {}
    for unit in units:
        out.setdefault(unit.host, []).append(unit)
    return out


def launch_dir(units: list[RenderedUnit]) -> str:
    return dict((v.key, v.value) for v in units[0].values)["launch_dir"]


def unit_url(unit: RenderedUnit) -> str:
    """Where the agent reaches the unit on its host: its port on loopback when it listens on all
    addresses, else its listen address."""
    v = dict((x.key, x.value) for x in unit.values)
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # noqa: S104 - mapped to loopback
    address = wildcard.get(v["listen_host"], v["listen_host"])
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{v['unit_port']}"


def unit_request(unit: RenderedUnit) -> dict[str, str]:
    return {
        "name": unit.name,
        "script_file": unit.script_file,
        "env_file": unit.env_file,
        "script": unit.script,
        "env": unit.env,
        # Only node rank 0 of a multi-node launch serves HTTP; the others are waited on by liveness.
        "url": unit_url(unit) if unit.node_rank == 0 else None,
    }


def launch_units(
    agent: AgentSession,
    units: list[RenderedUnit],
    say: Callable[[str], None],
    settle: float = 1.0,
    *,
    sets: tuple[str, ...] = (),
    wait: float | None = None,
    variant: str | None = None,
) -> LaunchReply:
    """Write the host's units there, start each detached, record pids (and the --set values, so a
    bench baseline renders the same launch); refused while one still runs. `wait`: seconds to wait
    for every unit to serve (the agent polls /health on the host), None for no wait."""
    request = {
        "target": {"name": agent.host.name},
        "base": launch_dir(units),
        "topology": units[0].topology,
        "units": [unit_request(u) for u in units],
        "settle": settle,
        "sets": list(sets),
        "variant": variant,
        "wait": wait,
        "options": {"pause": os.environ.get("DDEPLOY_TEST_AGENT_PAUSE", "")},  # a test-only window
    }
    return agent.call("launch", request, LaunchReply, stream=say)


def launch(
    hosts: list[Host],
    topology: str,
    sets: tuple[str, ...],
    say: HostSay,
    *,
    dry_run: bool = False,
    command: str = "ddeploy launch",
    wait: float | None = None,
) -> dict[str, LaunchReply | list[RenderedUnit]]:
    """Render for the hosts (kernel builds read from them), then start each host's units (and with
    `wait`, wait until they serve). Dry run: the rendered units per host, nothing started."""
    try:  # a bad topology or --set fails before any host is contacted
        offline = render_hosts(hosts, topology, sets)
    except RenderError as exc:
        if exc.host is None and len(hosts) == 1:
            exc.host = hosts[0].name
        raise
    with ExitStack() as stack:
        agents = {h.name: stack.enter_context(agent_session(h, command=command)) for h in hosts}
        cpu_engine = dict((v.key, v.value) for v in offline[0].values)["cpu_engine"]
        probed = {} if cpu_engine else probed_values(agents, say)  # the CPU engine builds no kernels
        units = by_host(render_hosts(hosts, topology, sets, probed=probed))
        if dry_run:
            return units
        return start_everywhere(agents, units, sets, say, wait)


def start_everywhere(
    agents: dict[str, AgentSession],
    units: dict[str, list[RenderedUnit]],
    sets: tuple[str, ...],
    say: HostSay,
    wait: float | None,
) -> dict[str, LaunchReply | list[RenderedUnit]]:
    """Start every host's units (one agent operation per host; with `wait` it also waits until
    they serve). A failure anywhere (a refused start, a unit that exits, Ctrl-C) stops what this
    command started on every host before it is raised; a host's own failed start stops itself."""
    if wait is not None and len(units) > 1:
        return start_and_wait_together(agents, units, sets, say, wait)
    replies: dict[str, LaunchReply | list[RenderedUnit]] = {}
    try:
        for name, host_units in units.items():
            say_host = lambda m, n=name: say(m, n)  # noqa: E731
            replies[name] = launch_units(agents[name], host_units, say_host, sets=sets, wait=wait)
    except BaseException:
        for name in replies:
            stop_served(agents[name], launch_dir(units[name]), lambda m, n=name: say(m, n))
        raise
    return replies


def start_and_wait_together(
    agents: dict[str, AgentSession],
    units: dict[str, list[RenderedUnit]],
    sets: tuple[str, ...],
    say: HostSay,
    wait: float,
) -> dict[str, LaunchReply | list[RenderedUnit]]:
    """Multi-node `--wait`: each host starts its units and waits for them in one agent operation
    (one hold of its launch lock), every host at once: the server forms only with every node up.
    When one fails (or Ctrl-C), the operations still running are cut (their connections closed:
    each agent sees its client go and stops what it started) and the hosts that had finished are
    stopped by this command, before the failure is raised."""
    pool = ThreadPoolExecutor(len(units), thread_name_prefix="launch")
    futures = {
        name: pool.submit(launch_units, agents[name], host_units, lambda m, n=name: say(m, n), sets=sets, wait=wait)
        for name, host_units in units.items()
    }
    try:
        for future in as_completed(futures.values()):
            future.result()
    except BaseException:
        cut = [name for name, future in futures.items() if not future.done()]
        for name in cut:
            agents[name].conn.close()
        pool.shutdown(wait=True)
        for name, future in futures.items():
            if future.exception() is None:  # it served: stop it (over a new connection if it was cut)
                stop_served(agents[name], launch_dir(units[name]), lambda m, n=name: say(m, n), fresh=name in cut)
        raise
    pool.shutdown(wait=True)
    return {name: future.result() for name, future in futures.items()}


def stop_served(agent: AgentSession, base: str, say: Callable[[str], None], *, fresh: bool = False) -> None:
    """Stop the launch this command started on the host, after a failure elsewhere (`fresh`: over
    a new connection, the command's own was cut); a problem here is said, never raised over the
    failure being reported."""
    try:
        if not fresh:
            stop_quietly(agent, base, say)
            return
        with agent_session(agent.host, command=agent.command) as again:
            stop_quietly(again, base, say)
    except DeployError as exc:
        say(f"could not stop the launch started here: {exc} (`ddeploy stop --host {agent.host.name}` stops it)")


def stop_launch(agent: AgentSession, base: str, say: Callable[[str], None], grace: float = 30.0) -> StopReply:
    """Stop exactly the processes the host's last launch recorded (verified by start time)."""
    request = {"target": {"name": agent.host.name}, "base": base, "grace": grace}
    return agent.call("stop", request, StopReply, stream=say, timeout=grace + 60)


def stop_quietly(agent: AgentSession, base: str, say: Callable[[str], None]) -> None:
    """Stop the host's last launch if it still runs (nothing to stop is fine)."""
    try:
        stop_launch(agent, base, say)
    except StateError:
        pass


def wait_serving(
    agent: AgentSession,
    timeout: float,
    say: Callable[[str], None],
    base: str | None = None,
    *,
    started_here: bool = False,
) -> WaitReply:
    """Until every unit of the host's last launch serves (the agent polls /health there); what each
    serves, from /server_info. A unit that exits, or is not healthy in `timeout` s, fails with its
    log's last lines; `started_here` (this command started them): the launch is stopped then."""
    request = {
        "target": {"name": agent.host.name},
        "base": base or launch_dir_for(agent.host),
        "timeout": timeout,
        "started_here": started_here,
    }
    return agent.call("wait", request, WaitReply, stream=say, timeout=timeout + 120)


def logs(host: Host, sets: tuple[str, ...], lines: int, follow: bool, out: Callable[[str], None]) -> LogsReply:
    """The last launch's logs, line by line to `out`; --follow ends when the server exits."""
    request = {"target": {"name": host.name}, "base": launch_dir_for(host, sets), "lines": lines, "follow": follow}
    with agent_session(host, command="ddeploy logs") as agent:
        return agent.call("logs", request, LogsReply, stream=out)


def stop(host: Host, sets: tuple[str, ...], say: Callable[[str], None], grace: float = 30.0) -> StopReply:
    """Stop exactly the processes the last launch recorded (verified by start time)."""
    with agent_session(host, command="ddeploy stop") as agent:
        return stop_launch(agent, launch_dir_for(host, sets), say, grace)
