"""How the suite is laid out for parallel runs (docs/testing.md): each module here is one pytest-xdist
group, and the groups really reach the scheduler (a pytest that xdist cannot tag silently runs the
suite ungrouped: the CPU-engine tests then start every server once per worker)."""

from __future__ import annotations


def test_each_module_is_one_xdist_group_and_the_group_reaches_the_scheduler(request):
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None and marker.args == ("test_suite_layout.py",)
    if getattr(request.config.option, "loadgroup", False):  # a worker of `--dist loadgroup`
        assert request.node.nodeid.endswith("@test_suite_layout.py"), request.node.nodeid
