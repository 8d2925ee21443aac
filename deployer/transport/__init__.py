"""Getting to a host and talking to it:

connection.py     open_connection: an SSH host or this machine (it names the parts below)
command.py        the Connection interface: argv commands, RunResult, commands started early
local.py          this machine as a host (subprocesses)
ssh_connection.py an SSH host: commands on paramiko channels, exit signals, a cut link
timeouts.py       connect and command timeouts, from the environment (no paramiko)
retries.py        which connect failures are tried again
control.py        connections kept open between commands (ControlPersist): the client side
control_master.py the process that keeps them
wire.py           the frames between a command and its connection master
endpoint.py       what the SSH layer reads of an inventory host (the master's hosts: no pydantic)
connect_errors.py one line per failed connect
ssh.py            a host's fabric.Connection and ProxyJump gateways, strict host keys on every hop
agent_client.py   ships the agent (deployer/agent/, one bundle) over one connection per command,
                  validates its replies
protocol.py       the typed models of the agent's replies and of the host's records
"""
