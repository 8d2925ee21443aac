"""Getting to a host and talking to it:

connection.py     an SSH host or this machine; argv commands; connect retries
ssh.py            a host's fabric.Connection and ProxyJump gateways, strict host keys on every hop
agent_client.py   ships the agent (deployer/agent/, one bundle) over one connection per command,
                  validates its replies
protocol.py       the typed models of the agent's replies and of the host's records
"""
