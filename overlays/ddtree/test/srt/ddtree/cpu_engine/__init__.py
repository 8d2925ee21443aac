"""Test-only harness: a real SGLang 0.5.23 ``sglang.launch_server`` on a CPU machine.

``models`` writes tiny random checkpoints, ``cpu_tree`` makes a scratch SGLang copy
with the test-only CPU changes (and the ``sgl_kernel`` stand-in beside it),
``server`` starts and drives a server, ``fixtures`` wires them into pytest,
``local_profile`` prepares both for the deploy tool's ``cpu-tiny`` launch profile.
Nothing here is part of the released wiring.
"""
