"""Getting to a host and talking to it:

connection.py     an SSH host or this machine; argv commands; connect retries
ssh.py            a host's fabric.Connection and ProxyJump gateways, strict host keys on every hop
agent.py          the stdlib-only program that runs on the host and owns everything there
agent_client.py   runs the agent over one connection per command, validates its replies
protocol.py       the typed models of the agent's replies and of the host's records
"""
