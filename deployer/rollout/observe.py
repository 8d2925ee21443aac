"""What each host runs before a rollout: its applied release and what its last launch serves,
read over one agent session per host, all hosts at once. A launch that is recorded running but
does not answer /health refuses the rollout: a unit must serve before it is measured and changed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..errors import StateError
from ..inventory import Host
from ..ops.launch import wait_serving
from ..render import launch_dir_for
from ..render.profiles import load_profiles
from ..render.values import parse_sets
from ..transport.agent_client import agent_session
from ..transport.protocol import StateReply
from .plan import Serving

HEALTH_WAIT_S = 30.0  # how long a running launch may take to answer /health here


def observe(hosts: list[Host], command: str) -> tuple[dict[str, Serving | None], dict[str, str | None]]:
    """({host: what it serves, None when nothing}, {host: applied version, None when pristine})."""
    with ThreadPoolExecutor(max(1, min(8, len(hosts))), thread_name_prefix="observe") as pool:
        found = list(pool.map(lambda h: _one(h, command), hosts))
    return {h.name: f[0] for h, f in zip(hosts, found, strict=True)}, {
        h.name: f[1] for h, f in zip(hosts, found, strict=True)
    }


def _one(host: Host, command: str) -> tuple[Serving | None, str | None]:
    with agent_session(host, command=command) as agent:
        state = agent.call("state", {}, StateReply).state
        version = state.applied.version if state.applied else None
        try:
            served = wait_serving(agent, HEALTH_WAIT_S, lambda _: None, launch_dir_for(host))
        except StateError as exc:
            if "nothing was launched" in str(exc) or "is not running" in str(exc):
                return None, version
            raise
    record = served.record
    return Serving(record.topology, tuple(record.sets), _nnodes(record.topology, record.sets)), version


def _nnodes(topology: str, sets: list[str]) -> int:
    profiles = load_profiles()
    values = profiles.topologies[topology].values if topology in profiles.topologies else {}
    chosen = dict(parse_sets(sets)).get("nnodes", values.get("nnodes", profiles.defaults["nnodes"]))
    return int(chosen)
