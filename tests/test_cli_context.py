"""The CLI's shared state: one frozen Selection of hosts, and the command line as typed (recorded
by the host's lock owner and journal), also for in-process callers such as these tests."""

from __future__ import annotations

import dataclasses

import pytest

from deployer.cli.context import AppContext, Selection


def test_the_command_line_is_the_callers_argv_quoted_as_typed():
    app = AppContext(argv=("-i", "my hosts", "push", "--host", "b300", "--version", "0.1.1"))
    assert app.command == "ddeploy -i 'my hosts' push --host b300 --version 0.1.1"


def test_selection_is_frozen_and_refuses_all_with_names():
    sel = Selection(names=("h1",), all_hosts=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.parallel = 1  # type: ignore[misc]
    from deployer.errors import UsageError

    with pytest.raises(UsageError, match="--all already selects every host"):
        sel.hosts(AppContext())
    with pytest.raises(UsageError, match="choose hosts with --host NAME"):
        Selection().hosts(AppContext())
