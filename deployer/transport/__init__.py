"""Getting to a host and talking to it:

connection.py     open_connection: an SSH host or this machine (it names the parts below)
command.py        the Connection interface: argv commands, RunResult, commands started early
local.py          this machine as a host (subprocesses)
ssh_connection.py an SSH host: commands on paramiko channels, exit signals, a cut link
retries.py        connect timeouts and which failures are tried again
connect_errors.py one line per failed connect
ssh.py            a host's fabric.Connection and ProxyJump gateways, strict host keys on every hop
agent_client.py   ships the agent (deployer/agent/, one bundle) over one connection per command,
                  validates its replies
protocol.py       the typed models of the agent's replies and of the host's records
"""
