"""Is a host's launch idle, and does it generate: the agent's `drain` and `health` operations,
the checks made around a unit's restart (`ddeploy rollout`: drain before a unit is stopped,
health after it is started again).

Both run on the host against the units of its last launch that serve HTTP, under its launch
lock, so no port is forwarded; nothing launched or nothing running there is a StateError.
drain polls each unit's /metrics (SGLang's `sglang:num_running_reqs` and `sglang:num_queue_reqs`
gauges, served with --enable-metrics, which the rendered scripts pass) until they read 0 or its
timeout passes; a unit without those gauges fails it (RemoteCommandError). health asks every
unit's /health_generate at once, where SGLang generates one token.

    with agent_session(host) as agent:
        if not drain(agent, 120.0, say).drained: ...
        bad = [u for u in health(agent).units if u.status != 200]
"""

from __future__ import annotations

from typing import Callable

from ..render import launch_dir_for
from ..transport.agent_client import AgentSession
from ..transport.protocol_serving import DrainReply, HealthReply, RouterReply

SLACK = 30.0  # seconds the client allows beyond the host's own bound (connect, lock wait, reply)


def request_for(agent: AgentSession, timeout: float, base: str | None) -> dict:
    return {"target": {"name": agent.host.name}, "base": base or launch_dir_for(agent.host), "timeout": timeout}


def drain(
    agent: AgentSession, timeout: float, say: Callable[[str], None], *, poll: float = 1.0, base: str | None = None
) -> DrainReply:
    """Wait up to `timeout` s until no unit of the host's last launch runs or queues a request;
    `drained` False (with the counts at the last poll) when the time ran out."""
    request = dict(request_for(agent, timeout, base), poll=poll)
    return agent.call("drain", request, DrainReply, stream=say, timeout=timeout + 2 * SLACK)


def health(agent: AgentSession, timeout: float = 60.0, *, base: str | None = None) -> HealthReply:
    """Each serving unit's /health_generate status (all at once, each bounded by `timeout` s);
    a unit that gave no answer has status None and says why in `error`."""
    return agent.call("health", request_for(agent, timeout, base), HealthReply, timeout=timeout + SLACK)


def router(
    agent: AgentSession, action: str, say: Callable[[str], None], *, timeout: float = 60.0
) -> RouterReply | None:
    """Take the host's serving units out of its router (`action` "remove") or put them back
    ("add"), waiting until the router shows it; None when the inventory names no router."""
    host = agent.host
    if host.router is None:
        return None
    where = {"router": host.router.url, "worker_url": host.worker_url(), "action": action}
    request = dict(request_for(agent, timeout, None), **where)
    return agent.call("router", request, RouterReply, stream=say, timeout=timeout + SLACK)
