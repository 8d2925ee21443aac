"""Getting to a host and talking to it:

connection.py     SSH (paramiko via Fabric, strict host keys) or this machine; argv commands
agent.py          the stdlib-only program that runs on the host and owns everything there
agent_client.py   runs the agent over one connection per command, validates its replies
protocol.py       the typed models of the agent's replies and of the host's records
"""
