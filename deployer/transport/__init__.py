"""Getting to a host and talking to it:

connection.py     SSH (paramiko, strict host keys) or this machine; argv commands
ssh_config.py     a host's connection settings and ProxyJump hops, read from its ssh_config
agent.py          the stdlib-only program that runs on the host and owns everything there
agent_client.py   runs the agent over one connection per command, validates its replies
protocol.py       the typed models of the agent's replies and of the host's records
"""
