"""The parsers and checks behind `ddeploy build` / `ddeploy test`, on the real tools' output formats."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from deployer.ops.overlay_tests import parse_junit
from deployer.locations import OVERLAYS_DIR
from deployer.agent.toolkit import Toolkit, check_toolkit_supports, parse_nvcc_version, parse_nvidia_smi
from deployer.agent.common import Fail
from deployer.agent.overlay_tests import junit_totals

NVCC_12_9 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Tue_May_27_02:21:03_PDT_2025
Cuda compilation tools, release 12.9, V12.9.86
Build cuda_12.9.r12.9/compiler.36037853_0
"""


def host(arch: str) -> dict:
    """The inventory facts the agent gets for a host (deployer.ops.kernel_build.target)."""
    major, minor = int(arch[3:-1]), int(arch[-1])
    return {
        "name": "h",
        "source": "hosts/h.yaml",
        "python": "python3",
        "arch": arch,
        "capability": [major, minor],
        "model": "m",
    }


def test_nvidia_smi_csv_is_parsed_per_gpu():
    text = "NVIDIA B300 SXM6, 10.3\nNVIDIA B300 SXM6, 10.3\n"
    assert parse_nvidia_smi(text) == [("NVIDIA B300 SXM6", (10, 3))] * 2


def test_nvidia_smi_garbage_is_an_error():
    with pytest.raises(Fail, match="cannot read nvidia-smi output line"):
        parse_nvidia_smi("No devices were found\n")


def test_nvcc_version_is_read_from_the_release_line():
    assert parse_nvcc_version(NVCC_12_9) == (12, 9)
    assert parse_nvcc_version("garbage") is None


@pytest.mark.parametrize(
    "arch,version,ok",
    [("sm_120", (12, 8), True), ("sm_100", (12, 7), False), ("sm_103", (12, 8), False), ("sm_103", (12, 9), True)],
)
def test_minimum_nvcc_per_arch(arch, version, ok):
    toolkit = Toolkit("/usr/local/cuda", version, None)
    if ok:
        check_toolkit_supports(host(arch), toolkit)
    else:
        with pytest.raises(Fail, match=rf"{arch} needs nvcc >= 12\.\d, but /usr/local/cuda/bin/nvcc is"):
            check_toolkit_supports(host(arch), toolkit)


def test_the_arch_list_of_nvcc_is_checked_too():
    toolkit = Toolkit("/usr/local/cuda", (13, 0), frozenset({"compute_90", "compute_100"}))
    with pytest.raises(Fail, match="cannot build sm_120"):
        check_toolkit_supports(host("sm_120"), toolkit)


def test_junit_totals(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
        'skipped="3" tests="10" time="4.5"></testsuite></testsuites>'
    )
    summary = parse_junit(report)
    assert (summary.passed, summary.failed, summary.errors, summary.skipped) == (4, 2, 1, 3)
    assert not summary.ok and summary.describe() == "4 passed, 2 failed, 3 skipped, 1 errors in 4.5s"
    on_host = junit_totals(report.read_text())  # the agent's reading of the same report
    assert on_host == {"tests": 10, "passed": 4, "failed": 2, "errors": 1, "skipped": 3, "duration": 4.5}


def test_build_errors_from_the_agent_are_build_errors():
    with pytest.raises(Fail) as exc:
        parse_nvidia_smi("No devices were found\n")
    assert exc.value.kind == "BuildError"


def _ddtree_build():
    path = OVERLAYS_DIR / "ddtree/python/sglang/srt/speculative/ddtree_build.py"
    spec = importlib.util.spec_from_file_location("ddtree_build_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "text,want", [("12.0", (12, 0)), ("10.3", (10, 3)), ("sm_120", (12, 0)), ("sm_103a", (10, 3)), ("120f", (12, 0))]
)
def test_prebuild_reads_arch_spellings(text, want):
    assert _ddtree_build().parse_arch(text) == want


def test_prebuild_rejects_a_bad_arch():
    with pytest.raises(ValueError, match="expected e.g. 12.0"):
        _ddtree_build().parse_arch("blackwell")


def test_prebuild_skips_the_sampling_kernel_on_a_toolkit_without_curand(tmp_path):
    if any(Path(d, "curand.h").exists() for d in ("/usr/include", "/usr/local/include")):
        pytest.skip("this machine has cuRAND's headers outside any toolkit")
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "targets" / "x86_64-linux" / "include").mkdir(parents=True)
    build = _ddtree_build()
    reason = build.curand_skip_reason(toolkit)
    assert reason.startswith(f"the CUDA toolkit at {toolkit} has no cuRAND headers (curand.h, which flashinfer's")
    (toolkit / "targets" / "x86_64-linux" / "include" / "curand.h").write_text("")
    assert build.curand_skip_reason(toolkit) is None
