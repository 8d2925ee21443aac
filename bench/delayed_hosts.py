"""The bench's sshd hosts seen through a DelayProxy: the same hosts, reached over a link with a round trip.

    fleet = SshdFleet.start(...)                      # tests/sshd_hosts.py: sshd on 127.0.0.N
    link = DelayProxy(rtt_s=0.030)
    view = behind_proxy(fleet, link, root)            # an SshdFleet whose hosts are the proxy's
    view.inventory_dir, view.ssh_config, view.known_hosts, view.hosts[i].address / .port

Each host gets a forwarder on 127.0.1.N (its sshd's last octet, port chosen by the kernel); the
view's ssh_config, known_hosts (`[127.0.1.N]:port` with the host's key) and inventory name those,
so Ansible, pyinfra and ddeploy all connect through the proxy. The view shares the hosts'
checkouts and keys and owns no sshd: reset and close the fleet itself, never the view.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from delay_proxy import DelayProxy
from sshd_hosts import SshdFleet

PROXY_NET = "127.0.1."


def behind_proxy(fleet: SshdFleet, link: DelayProxy, root: Path) -> SshdFleet:
    """A view of `fleet` whose hosts are forwarders of `link`, with client files of its own under root."""
    root.mkdir(parents=True, exist_ok=True)
    hosts = [_through(link, h) for h in fleet.hosts]
    view = dataclasses.replace(
        fleet,
        root=root,
        hosts=hosts,
        known_hosts=root / "known_hosts",
        ssh_config=root / "ssh_config",
        inventory_dir=root / "inventory",
    )
    view.write_client_files(sys.executable)  # the hosts' python, as SshdFleet.start writes it
    return view


def _through(link: DelayProxy, host):
    """The host as a client sees it behind its forwarder (no sshd process: the fleet owns that)."""
    address = PROXY_NET + host.address.rsplit(".", 1)[1]
    port = link.forward(address, (host.address, host.port))
    return dataclasses.replace(host, address=address, port=port, proc=None)
