"""`ddeploy rollout`: a fleet from one release to the next, a unit at a time, behind gates.

The flow, one module each:

    spec.py       the rollout file (batches, max fail, min available, deadlines, measurements,
                  thresholds) and the CLI options over it
    observe.py    what each host runs now: applied release, what its launch serves
    plan.py       units (a host, or a multi-node launch's group), canary, batches; refusals
    journal.py    the JSON Lines event log (also the state --resume replays) and host locks
    unit_steps.py one unit: measure, drain and stop, push + build + tests, launch, gates, put back
    gates.py      the measurement after the change against the one before it
    runner.py     canary, batches, max fail, pause, abort, Ctrl-C
"""
