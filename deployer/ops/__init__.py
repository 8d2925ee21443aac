"""Host operations, one module per stage of the flow: deploy (push/plan/status/rollback/log/lock),
kernel_build, overlay_tests, launch, and fleet (the same operation over many hosts).

Every operation does the whole job for one host through one agent session (one SSH connection)
and returns an Outcome holding the agent's typed reply; failures raise DeployError subclasses.
Nothing here renders: deployer/cli/ turns outcomes into tables, progress lines and --json.
"""
