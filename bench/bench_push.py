"""Benchmark: ddeploy push against Ansible and pyinfra 3, same hosts, same run, alternating.

    .venv/bin/python bench/bench_push.py [--sizes 1,8,32] [--reps 3] [--rtt-ms 30] [--tools-venv DIR]
                                         [--version DIR|V] [--checkout]

Starts its own OpenSSH hosts (tests/sshd_hosts.py) on loopback, each with a clone of the pristine
SGLang base, and puts a link with a real round trip in front of them: a delaying TCP proxy per
host (bench/delay_proxy.py, bench/delayed_hosts.py; --rtt-ms, default 30; 0: straight to the
loopback sshd, where a round trip costs nothing). Every tool connects through it; a TCP
ping-pong through the proxy before the run (which stops unless it takes at least 95% of the
round trip asked for) and after it is printed with the table, and the proxy's CPU time.
Times, per fleet size, the first push of a patch set and a second (no-op) push right after it,
each tool with its default connection reuse:
  * ddeploy: `ddeploy push` (the real CLI as a subprocess, --parallel 8); the first push connects
    (a connection master), the no-op push runs over the connection it kept (control.py);
  * Ansible (ansible-core): copy the set, `git apply -R --check` (applied already?), else
    `git apply --index`; forks 8, strict host keys through the same ssh_config, and Ansible's
    default ssh arguments (ControlMaster=auto, ControlPersist=60s; --ansible-ssh-args to change);
  * pyinfra 3: `files.sync` of the set plus the same git commands, --parallel 8 (no reuse).
Before every first push the kept connections of both are closed: a first push always connects.
Ansible and pyinfra come from --tools-venv (default /tmp/bench-venv: `python -m venv
/tmp/bench-venv && /tmp/bench-venv/bin/pip install ansible-core 'pyinfra>=3,<4'`), never from
the project venv; a tool that is not installed is skipped. The tools run alternately, each
repetition on freshly reset checkouts; medians of --reps. Also prints one `ssh host true` round
trip through the link (timed in every round, beside the tools; and once more over an OpenSSH
ControlMaster, for scale) and `ddeploy --version` / `--help` start-up times.
ddeploy runs as a user installs it: `pip install` of this checkout into a virtual environment
of its own (--checkout: from this checkout's .venv). Asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from sshd_hosts import SshdFleet, build_test_patch_sets  # noqa: E402

from delay_proxy import DelayProxy  # noqa: E402
from delayed_hosts import behind_proxy  # noqa: E402
from deployer.cli.output import table  # noqa: E402
from deployer.patchset import load_patch_set  # noqa: E402

TOOL_DIRS = (".git/ansible-sets", ".git/pyinfra-sets")
ANSIBLE_DEFAULT_SSH_ARGS = "-C -o ControlMaster=auto -o ControlPersist=60s"  # ansible-core's ssh_args

PLAYBOOK = """- hosts: all
  gather_facts: false
  tasks:
    - name: copy the patch set
      ansible.builtin.copy:
        src: "{{ set_dir }}/"
        dest: "{{ checkout }}/.git/ansible-sets/{{ version }}/"
    - name: is it applied already
      ansible.builtin.command: "git -C {{ checkout }} apply -R --check {{ reversed_patches }}"
      register: applied
      failed_when: false
      changed_when: false
    - name: apply the patch set
      ansible.builtin.command: "git -C {{ checkout }} apply --index {{ patches }}"
      when: applied.rc != 0
"""

PYINFRA_DEPLOY = """from pyinfra import host
from pyinfra.operations import files, server

d = host.data
files.sync(name="sync the patch set", src=d.set_dir, dest=d.checkout + "/.git/pyinfra-sets/" + d.version)
server.shell(name="apply unless applied", commands=[
    "git -C " + d.checkout + " apply -R --check " + d.reversed_patches
    + " || git -C " + d.checkout + " apply --index " + d.patches])
"""


def timed(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall


class Tools:
    """The three ways to push, over the same hosts."""

    def __init__(
        self, fleet: SshdFleet, set_dir: Path, work: Path, tools_venv: Path, ansible_ssh_args: str, ddeploy: list[str]
    ):
        self.fleet, self.work, self.ansible_ssh_args, self.ddeploy = fleet, work, ansible_ssh_args, ddeploy
        ps = load_patch_set(str(set_dir))
        self.version = ps.version
        self.set_dir = set_dir
        self.patches = [f".git/{{d}}/{ps.version}/{p.name}" for p in ps.patches]
        self.ansible = tools_venv / "bin" / "ansible-playbook"
        self.pyinfra = tools_venv / "bin" / "pyinfra"
        work.mkdir(parents=True, exist_ok=True)
        (work / "playbook.yml").write_text(PLAYBOOK)
        (work / "deploy.py").write_text(PYINFRA_DEPLOY)

    def available(self) -> list[str]:
        return ["ddeploy"] + [n for n, p in (("ansible", self.ansible), ("pyinfra", self.pyinfra)) if p.exists()]

    def _paths(self, tool_dir: str, checkout: Path) -> tuple[str, str]:
        names = [str(checkout / p.format(d=tool_dir.split("/", 1)[1])) for p in self.patches]
        return " ".join(names), " ".join(reversed(names))

    def run(self, tool: str, n: int) -> float:
        hosts = self.fleet.hosts[:n]
        return getattr(self, f"_run_{tool}")(hosts)

    def _run_ddeploy(self, hosts) -> float:
        args = [*self.ddeploy, "-i", str(self.fleet.inventory_dir), "push", "--version", str(self.set_dir), "-j", "8"]
        return timed(args + [w for h in hosts for w in ("--host", h.name)])

    def _run_ansible(self, hosts) -> float:
        lines = ["[all]"]
        for h in hosts:
            fwd, rev = self._paths(TOOL_DIRS[0], h.checkout)
            lines.append(
                f"{h.name} checkout={h.checkout} patches='{fwd}' reversed_patches='{rev}' "
                f"ansible_python_interpreter=/usr/bin/python3"
            )
        (self.work / "ansible.ini").write_text("\n".join(lines) + "\n")
        env = {
            **os.environ,
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            # Ansible's own default (-C -o ControlMaster=auto -o ControlPersist=60s), plus the config
            "ANSIBLE_SSH_ARGS": f"-F {self.fleet.ssh_config} {self.ansible_ssh_args}",
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.work / "ansible-cp"),
            "ANSIBLE_FORKS": "8",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_LOCAL_TEMP": str(self.work / "ansible-tmp"),
        }
        extra = json.dumps({"set_dir": str(self.set_dir), "version": self.version})
        argv = [str(self.ansible), "-i", str(self.work / "ansible.ini"), str(self.work / "playbook.yml")]
        return timed(argv + ["-e", extra], env=env)

    def _run_pyinfra(self, hosts) -> float:
        entries = []
        for h in hosts:
            fwd, rev = self._paths(TOOL_DIRS[1], h.checkout)
            data = {
                "ssh_hostname": h.address,
                "ssh_port": h.port,
                "ssh_user": "root",
                "ssh_key": str(self.fleet.client_key),
                "ssh_known_hosts_file": str(self.fleet.known_hosts),
                "ssh_strict_host_key_checking": "yes",
                "checkout": str(h.checkout),
                "set_dir": str(self.set_dir),
                "version": self.version,
                "patches": fwd,
                "reversed_patches": rev,
            }
            entries.append((h.name, data))
        (self.work / "inventory.py").write_text(f"hosts = {entries!r}\n")
        argv = [str(self.pyinfra), str(self.work / "inventory.py"), str(self.work / "deploy.py"), "-y"]
        return timed(argv + ["--parallel", "8"], cwd=self.work)


def close_kept_connections(work: Path) -> None:
    """No tool starts a first push with a connection kept from before: ddeploy's masters and
    Ansible's ControlPersist masters are closed."""
    from deployer.transport.control import disconnect

    disconnect()
    for sock in (work / "ansible-cp").glob("*"):
        subprocess.run(["ssh", "-S", str(sock), "-O", "exit", "kept"], capture_output=True)


def reset(fleet: SshdFleet, work: Path) -> None:
    close_kept_connections(work)
    fleet.reset()
    # A first push is one from a client that never shipped the set to these hosts.
    shutil.rmtree(Path(os.environ["DDEPLOY_CACHE_DIR"]) / "shipped", ignore_errors=True)
    for h in fleet.hosts:
        for d in TOOL_DIRS:
            shutil.rmtree(h.checkout / d, ignore_errors=True)


def install_ddeploy(into: Path, checkout: bool = False, source: Path = ROOT) -> tuple[Path, list[str]]:
    """ddeploy as a user installs it: (its python, the command that runs it). `pip install` of
    this checkout into a virtual environment of its own (ddeploy's dependencies only,
    byte-compiled by pip, as Ansible and pyinfra are in theirs), run by the `ddeploy` script pip
    writes. `checkout`: this checkout's own .venv instead (quicker to set up; its site-packages
    also hold the test suite's, torch and SGLang among them), byte-compiled: with
    PYTHONDONTWRITEBYTECODE set, as on this build machine, every run would compile it again."""
    if checkout:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "deployer")], check=True)
        return Path(sys.executable), [sys.executable, "-c", "from deployer.cli import main; main()"]
    venv = into / "ddeploy-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(source)], capture_output=True, text=True)
    if pip.returncode != 0:
        raise SystemExit(f"pip install {source} failed:\n{pip.stderr[-2000:]}")
    return venv / "bin" / "python", [str(venv / "bin" / "ddeploy")]


def add_checkout_option(ap: argparse.ArgumentParser) -> None:
    """--checkout, for install_ddeploy (every bench that runs ddeploy takes it)."""
    ap.add_argument("--checkout", action="store_true", help="run ddeploy from this checkout's .venv, not installed")


def startup_times(ddeploy: list[str], reps: int) -> tuple[float, float]:
    version = statistics.median(timed([*ddeploy, "--version"]) for _ in range(reps))
    help_ = statistics.median(timed([*ddeploy, "--help"]) for _ in range(reps))
    return version, help_


def through_link(fleet: SshdFleet, link: DelayProxy | None, root: Path) -> tuple[SshdFleet, str]:
    """The hosts as the tools reach them (behind the link's proxy, if any), and a line saying
    what round trip the link measured."""
    if link is None:
        return fleet, "link: loopback, straight to sshd (--rtt-ms 0)"
    hosts = behind_proxy(fleet, link, root)
    asked, measured = link.delay * 2, link.ping_pong()
    if measured < asked * 0.95:
        raise SystemExit(f"the delay proxy's round trip measured {measured * 1000:.1f} ms, under {asked * 1000:.0f} ms")
    line = f"link: a delay proxy before every host, {asked * 1000:.0f} ms round trip"
    return hosts, f"{line}; a TCP ping-pong through it: {measured * 1000:.1f} ms before the run"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rtt-ms", type=float, default=30.0, help="the link's round trip (0: direct, loopback)")
    ap.add_argument("--tools-venv", type=Path, default=Path("/tmp/bench-venv"))
    ap.add_argument(
        "--ansible-ssh-args",
        default=ANSIBLE_DEFAULT_SSH_ARGS,
        help="Ansible's ssh arguments besides -F (default: its own; `-o ControlMaster=no`: no reuse)",
    )
    ap.add_argument("--version", help="patch set (version or directory); default: a small generated 3-patch set")
    add_checkout_option(ap)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ddeploy-bench-") as tmp:
        _, ddeploy = install_ddeploy(Path(tmp), args.checkout)
        os.environ.setdefault("DDEPLOY_CACHE_DIR", str(Path(tmp) / "cache"))
        os.environ["DDEPLOY_CONTROL_DIR"] = str(Path(tmp) / "control")  # the bench's own kept connections
        real_base = Path.home() / ".cache" / "ddeploy" / "base"
        if real_base.is_dir() and not (Path(tmp) / "cache" / "base").exists():
            (Path(tmp) / "cache").mkdir()
            (Path(tmp) / "cache" / "base").symlink_to(real_base)  # read-only use of the built base
        set_dir = Path(args.version) if args.version else build_test_patch_sets(Path(tmp) / "sets")["v2"]
        if not set_dir.is_dir():
            from deployer.patchset import resolve_dir

            set_dir = resolve_dir(args.version)
        fleet = SshdFleet.start(Path(tmp) / "hosts", count=max(sizes), first_octet=31, prefix="b")
        link = DelayProxy(args.rtt_ms / 1000) if args.rtt_ms else None
        mux = ["ssh", "-o", "ControlMaster=auto", "-o", f"ControlPath={tmp}/ssh-%C", "-o", "ControlPersist=30"]
        try:
            hosts, link_line = through_link(fleet, link, Path(tmp) / "link")
            mux[1:1] = ["-F", str(hosts.ssh_config)]
            tools = Tools(hosts, set_dir, Path(tmp) / "work", args.tools_venv, args.ansible_ssh_args, ddeploy)
            names = tools.available()
            h = hosts.hosts[0]
            ssh = [
                "ssh", "-F", str(hosts.ssh_config), h.name, "true",
            ]  # fmt: skip
            rtts, times = [], {}
            for n in sizes:
                for _ in range(args.reps):
                    rtts.append(timed(ssh))  # in every round too, so the ratio compares like with like
                    for tool in names:  # alternating: one repetition of each tool, then the next round
                        reset(fleet, tools.work)
                        times.setdefault((tool, n, "first"), []).append(tools.run(tool, n))
                        times.setdefault((tool, n, "no-op"), []).append(tools.run(tool, n))
            if link is not None:
                after, cpu = link.ping_pong() * 1000, link.cpu_seconds()
                link_line += f"; after the run {after:.1f} ms, the proxy's CPU time {cpu:.2f} s"
            version, help_ = startup_times(ddeploy, args.reps)
            timed([*mux, *ssh[3:]])  # the master
            mux_rtt = statistics.median(timed([*mux, *ssh[3:]]) for _ in range(args.reps))
        finally:
            close_kept_connections(Path(tmp) / "work")
            subprocess.run([*mux, "-O", "exit", fleet.hosts[0].name], capture_output=True)
            if link is not None:
                link.close()
            fleet.close()
    rtt = statistics.median(rtts)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for n in sizes:
        for kind in ("first", "no-op"):
            row = [str(n), kind] + [f"{med[(t, n, kind)]:.2f}" for t in names]
            row += [f"{med[(t, n, kind)] / med[('ddeploy', n, kind)]:.1f}x" for t in names[1:]]
            rows.append(row)
    headers = ["hosts", "push"] + [f"{t} s" for t in names] + [f"{t} / ddeploy" for t in names[1:]]
    print(
        f"set {set_dir.name}, medians of {args.reps}; one `ssh host true`: {rtt:.2f} s "
        f"({mux_rtt:.2f} s over an OpenSSH ControlMaster); "
        f"no-op push of {sizes[0]} host(s) / ssh round trip: {med[('ddeploy', sizes[0], 'no-op')] / rtt:.2f}x"
    )
    print(f"ddeploy --version {version:.2f} s, --help {help_:.2f} s; Ansible's ssh args: {args.ansible_ssh_args}")
    print(link_line)
    print(f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    print(table(rows, headers))


if __name__ == "__main__":
    main()
