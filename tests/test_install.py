"""`pip install .` (not editable) into a fresh venv gives a working ddeploy: its templates and
released patch sets travel with it, and the inventory comes from -i, $DDEPLOY_HOSTS_DIR, ./hosts
or the user's config directory, never from a project checkout it does not have."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with ddeploy installed from a wheel of a copy of the project (its dependencies are
    borrowed from this venv by a plain path entry, so nothing is downloaded)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    shutil.copytree(
        PROJECT,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache"),
    )
    wheels = root / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    venv = root / "venv"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    [wheel] = wheels.glob("ddeploy-*.whl")
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(src)  # nothing may be found through the source it was built from
    return venv


def run(venv: Path, *args: str, cwd: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DDEPLOY_", "XDG_", "PYTHON"))}
    return subprocess.run(
        [str(venv / "bin" / "ddeploy"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**clean, "HOME": str(home), **env},
    )


def test_the_installed_package_is_the_wheels_not_this_checkout(installed, tmp_path):
    out = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import deployer; print(deployer.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith(str(installed)), out
    pkg = Path(out.strip()).parent
    assert (pkg / "agent" / "main.py").is_file() and not (pkg / "render" / "golden.py").exists()


def test_installed_ddeploy_finds_its_data_and_the_inventory_by_the_documented_order(installed, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    r = run(installed, "hosts", cwd=tmp_path, home=home)  # no inventory yet: `local`, and where one is read
    assert r.returncode == 0 and "no inventory yet" in r.stderr and "\nlocal " in r.stderr, r.stderr
    r = run(installed, "status", "--host", "gpu1", cwd=tmp_path, home=home)
    assert r.returncode == 3 and "no inventory: none of" in r.stderr and "pass -i DIR" in r.stderr, r.stderr
    r = run(installed, "patches", "list", cwd=tmp_path, home=home)
    assert r.returncode == 0 and "0.2.11" in r.stderr, r.stderr  # the released sets came with it
    assert "ddtree-0.1.0" in r.stderr  # and the record of the archived ones, which need the git history
    r = run(installed, "patches", "restore", "0.1.0", cwd=tmp_path, home=home)
    assert r.returncode == 4 and "is not in a git checkout (an installed ddeploy has no history)" in r.stderr
    user_hosts = home / ".config" / "ddeploy" / "hosts"
    shutil.copytree(PROJECT / "hosts", user_hosts)
    r = run(installed, "hosts", cwd=tmp_path, home=home)
    assert r.returncode == 0 and "rtx6000" in r.stderr, r.stderr
    r = run(installed, "render", "--host", "b300", "-t", "tp8", cwd=tmp_path, home=home)
    assert r.returncode == 0 and "sglang.launch_server" in r.stdout, r.stderr  # templates came with it
    (tmp_path / "hosts").mkdir()  # ./hosts comes before the config directory
    r = run(installed, "hosts", cwd=tmp_path, home=home)
    assert r.returncode == 0 and "rtx6000" not in r.stderr, r.stderr
    r = run(installed, "-i", str(user_hosts), "hosts", cwd=tmp_path, home=home)
    assert "rtx6000" in r.stderr
    r = run(installed, "patches", "export", cwd=tmp_path, home=home)
    assert r.returncode == 2 and "pass --overlay DIR or set DDEPLOY_OVERLAY_DIR" in r.stderr, r.stderr
