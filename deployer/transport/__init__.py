"""Getting to a host and talking to it:

connection.py         open_connection: an SSH host or this machine (it names the parts below)
command.py            the Connection interface: argv commands, RunResult, commands started early
direct.py             a command's own connection: this machine or an SSH host
local.py              this machine as a host (subprocesses)
ssh_connection.py     an SSH host: commands on paramiko channels, exit signals, a cut link
timeouts.py           connect and command timeouts, from the environment (no paramiko)
retries.py            which connect failures are tried again
control.py            connections kept open between commands (ControlPersist): open, disconnect
control_paths.py      their private socket directory, the sockets' names, the persist setting
master_start.py       starting a connection master (the client's import path, its log, the fallback)
shared_connection.py  a command over a kept connection (no paramiko in the client)
control_master.py     the process that keeps the connections (a socket, no process on the host)
peer_creds.py         who is at the other end of a Unix socket, per platform
wire.py               the frames between a command and its connection master
endpoint.py           what the SSH layer reads of an inventory host (the master's hosts: no pydantic)
connect_errors.py     one line per failed connect
ssh.py                a host's fabric.Connection and ProxyJump gateways, strict host keys on every hop
known_hosts.py        host keys checked as OpenSSH checks them
agent_bundle.py       the agent as it travels: its bundle, its sha256, the host's bootstrap
agent_client.py       agent calls over one connection per command, their replies validated
early_agents.py       connections opened and agents started while the client prepares the request
protocol.py           the typed models of the agent's replies and of the host's records
"""
