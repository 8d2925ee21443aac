"""Real OpenSSH test hosts on loopback, for tests and benchmarks (no pytest import here).

    fleet = SshdFleet.start(Path(tmp), count=3)    # 3 sshd on 127.0.0.N, random free ports
    fleet.hosts[0]         -> SshdHost(name="h1", address="127.0.0.11", port=..., checkout=Path, ...)
    fleet.inventory_dir    -> directory of host YAML files (pass as `ddeploy -i DIR`)
    fleet.ssh_config       -> ssh_config with one `Host <name>` alias per test host (root, client key,
                              known_hosts, StrictHostKeyChecking yes) plus `Host <name>-via-h1`
                              aliases that reach the host through h1 (ProxyJump)
    fleet.known_hosts, fleet.client_key
    host.stop() / host.start()   outage: stop kills the listener and its sessions; start restarts it
    host.rotate_host_key()       the host presents a new key (known_hosts now holds the old one)
    fleet.forget_host_key(host)  drop the host from known_hosts (unknown-key case)
    fleet.reset()                every host running with its original key, known_hosts rewritten,
                                 every checkout back at the pristine base (branch main, clean,
                                 refs/ddeploy/* and .git/ddeploy removed)
    fleet.close()                stop everything (also at interpreter exit)

Each host's checkout is its own full clone of the pristine SGLang base (`clone_base`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from processes import free_port, parent

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
BASE_ADDRESS = "127.0.0."


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True, capture_output=True
    )


def _wait_banner(address: str, port: int, deadline: float) -> None:
    """Ready means the server sends its `SSH-` banner (polling connects, no fixed sleep)."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError as exc:
            last = exc
        time.sleep(0.01)
    raise RuntimeError(f"sshd on {address}:{port} sent no banner ({last})")


@dataclass
class SshdHost:
    name: str
    address: str
    port: int
    root: Path  # per-host directory: sshd_config, keys, logs, checkout
    authorized_keys: Path
    checkout: Path = field(init=False)
    host_key: Path = field(init=False)
    original_host_key: Path = field(init=False)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    max_sessions: int = 50  # sshd's MaxSessions: channels open at once on one connection

    def __post_init__(self) -> None:
        self.checkout = self.root / "sglang"
        self.host_key = self.original_host_key = self.root / "ssh_host_ed25519_key"
        if not self.host_key.exists():
            _keygen(self.host_key, f"host-{self.name}")

    @property
    def cache_dir(self) -> Path:
        """The host's DDEPLOY_CACHE_DIR: its launch lock and records live in `launches/` there."""
        return self.root / "cache"

    @property
    def config_path(self) -> Path:
        return self.root / "sshd_config"

    @property
    def public_key(self) -> list[str]:
        """[key type, base64 key] of the key the host presents now."""
        return self.host_key.with_suffix(".pub").read_text().split()[:2]

    def known_hosts_line(self) -> str:
        ktype, key = self.public_key
        return f"[{self.address}]:{self.port} {ktype} {key}\n"

    def _write_config(self) -> None:
        self.config_path.write_text(
            "\n".join(
                [
                    f"ListenAddress {self.address}:{self.port}",
                    f"HostKey {self.host_key}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "UsePAM no",
                    "StrictModes no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    # like a stock sshd: Ansible and pyinfra (bench/bench_push.py) copy files over SFTP
                    "Subsystem sftp /usr/lib/openssh/sftp-server",
                    "AllowTcpForwarding yes",
                    "LogLevel ERROR",
                    "MaxStartups 100:30:200",
                    f"MaxSessions {self.max_sessions}",
                    # the agent's launch lock and records (~/.cache/ddeploy/launches on a real host)
                    f"SetEnv DDEPLOY_TEST_HOST={self.name} DDEPLOY_CACHE_DIR={self.cache_dir}",
                    "",
                ]
            )
        )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        self._write_config()
        log = open(self.root / "sshd.log", "ab")
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(self.config_path)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        try:
            _wait_banner(self.address, self.port, time.monotonic() + timeout)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        """Outage: the listener and every session it spawned die (commands started by a session
        keep running, as after a network cut; they are not sshd processes)."""
        if self.proc is None:
            return
        for pid in [*_sshd_descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None

    def rotate_host_key(self) -> None:
        """Restart with a brand-new host key (a reinstalled host or a man in the middle)."""
        new = self.root / f"rotated_host_key_{time.monotonic_ns()}"
        _keygen(new, f"rotated-{self.name}")
        self.stop()
        self.host_key = new
        self.start()

    def restore_host_key(self) -> None:
        if self.host_key != self.original_host_key:
            self.stop()
            self.host_key = self.original_host_key
        self.start()

    def git(self, *args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(self.checkout), *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    def reset_checkout(self, base_commit: str) -> None:
        """Back to the pristine base: branch main at the base commit, clean, no ddeploy refs/state."""
        shutil.rmtree(self.checkout / ".git" / "ddeploy", ignore_errors=True)
        for ref in self.git("for-each-ref", "--format=%(refname)", "refs/ddeploy").splitlines():
            self.git("update-ref", "-d", ref)
        self.git("checkout", "-q", "-f", "-B", "main", base_commit)
        self.git("clean", "-q", "-fdx")


def _sshd_descendants(pid: int) -> list[int]:
    """All descendants of pid whose command is sshd (the per-connection session processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = parent(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("sshd"):
            out.append(p)
            todo.extend(children.get(p, []))
    return out


@dataclass
class SshdFleet:
    root: Path
    hosts: list[SshdHost]
    client_key: Path
    known_hosts: Path
    ssh_config: Path
    inventory_dir: Path
    base_commit: str
    base_tree: str

    @classmethod
    def start(
        cls, root: Path, count: int = 3, *, first_octet: int = 11, python: str = sys.executable, prefix: str = "h"
    ) -> "SshdFleet":
        from deployer.patchset.sglang_base import clone_base, ensure_base

        if not Path(SSHD).is_file() or not shutil.which("rsync"):
            raise RuntimeError(
                "the sshd test hosts need openssh-server and rsync: "
                "apt-get install -y openssh-server rsync (scripts/test.sh does)"
            )
        root.mkdir(parents=True, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        base = ensure_base()
        client_key = root / "client_ed25519"
        _keygen(client_key, "ddeploy-test-client")
        authorized = root / "authorized_keys"
        shutil.copy(client_key.with_suffix(".pub"), authorized)
        hosts = []
        for i in range(count):
            address = f"{BASE_ADDRESS}{first_octet + i}"
            hdir = root / f"{prefix}{i + 1}"
            hdir.mkdir(exist_ok=True)
            hosts.append(SshdHost(f"{prefix}{i + 1}", address, free_port(address), hdir, authorized))
        fleet = cls(
            root,
            hosts,
            client_key,
            root / "known_hosts",
            root / "ssh_config",
            root / "inventory",
            base.commit,
            base.tree,
        )
        atexit.register(fleet.close)
        try:
            for h in hosts:
                h.start()
                clone_base(h.checkout)
            fleet.write_client_files(python)
        except BaseException:
            fleet.close()
            raise
        return fleet

    def write_client_files(self, python: str) -> None:
        self.write_known_hosts()
        blocks = []
        for h in self.hosts:
            blocks.append(self._ssh_block(h.name, h))
            blocks.append(
                self._ssh_block(f"{h.name}-via-{self.hosts[0].name}", h) + f"  ProxyJump {self.hosts[0].name}\n"
            )
        self.ssh_config.write_text("".join(blocks))
        self.inventory_dir.mkdir(exist_ok=True)
        for i, h in enumerate(self.hosts):
            doc = {
                "name": h.name,
                "ssh": {"host": h.name, "config": str(self.ssh_config)},
                "gpu": {
                    "model": "NVIDIA RTX PRO 6000 Blackwell Server Edition" if i % 2 == 0 else "NVIDIA B300 SXM6",
                    "count": 8,
                    "arch": "sm_120" if i % 2 == 0 else "sm_103",
                    "memory_gib": 96 if i % 2 == 0 else 288,
                },
                "interconnect": "pcie" if i % 2 == 0 else "nvlink",
                "checkout": str(h.checkout),
                "python": python,
                "groups": ["test", "even" if i % 2 else "odd"],
            }
            (self.inventory_dir / f"{h.name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

    def _ssh_block(self, alias: str, h: SshdHost) -> str:
        return (
            f"Host {alias}\n  HostName {h.address}\n  Port {h.port}\n  User root\n"
            f"  IdentityFile {self.client_key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {self.known_hosts}\n"
            f"  StrictHostKeyChecking yes\n  BatchMode yes\n"
        )

    def write_known_hosts(self) -> None:
        self.known_hosts.write_text("".join(h.known_hosts_line() for h in self.hosts))

    def forget_host_key(self, host: SshdHost) -> None:
        self.known_hosts.write_text("".join(h.known_hosts_line() for h in self.hosts if h is not host))

    def host(self, name: str) -> SshdHost:
        return next(h for h in self.hosts if h.name == name)

    def reset(self) -> None:
        for h in self.hosts:
            h.restore_host_key()
            h.reset_checkout(self.base_commit)
        self.write_known_hosts()

    def close(self) -> None:
        for h in self.hosts:
            h.stop()


# ---------------------------------------------------------------- small patch sets for tests
def make_patch_set(
    dest: Path, version: str, concerns: list[tuple[str, dict[str, str | None]]], *, base_path: Path | None = None
) -> Path:
    """A released-style patch set at dest (series, manifest.yaml with sha256s, git format-patch
    patches against the pristine base). Each concern maps repo paths to their new full content
    (None deletes); a "+=" prefix appends to the base content: {"python/sglang/version.py": "+=# x\\n"}."""
    import hashlib

    from deployer.patchset.sglang_base import ensure_base
    from deployer.patchset.local_git import FIXED_IDENTITY

    base = ensure_base()
    work = dest.parent / f".{dest.name}-work"
    # Plumbing on a no-checkout clone: no work tree of 5,000+ files to write.
    subprocess.run(
        ["git", "clone", "-q", "--shared", "--no-checkout", str(base_path or base.path), str(work)], check=True
    )
    env = {**os.environ, **FIXED_IDENTITY}

    def git(*args: str, input: bytes | None = None) -> str:
        return (
            subprocess.run(["git", "-C", str(work), *args], check=True, env=env, input=input, capture_output=True)
            .stdout.decode()
            .strip()
        )

    git("read-tree", "HEAD")
    for concern, files in concerns:
        for rel, content in files.items():
            if content is None:
                git("update-index", "--force-remove", rel)
                continue
            old = git("show", f"HEAD:{rel}") + "\n" if content.startswith("+=") else ""
            blob = git("hash-object", "-w", "--stdin", input=(old + content.removeprefix("+=")).encode())
            git("update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}")
        commit = git("commit-tree", git("write-tree"), "-p", "HEAD", "-m", concern)
        git("update-ref", "HEAD", commit)
    dest.mkdir(parents=True)
    subprocess.run(
        ["git", "-C", str(work), "format-patch", "-q", "--no-signature", "--zero-commit", "-o", str(dest), base.commit],
        check=True,
        env=env,
    )
    entries = []
    for i, (concern, _files) in enumerate(concerns, 1):
        produced = sorted(dest.glob(f"{i:04d}-*.patch"))[0]
        final = dest / f"{i:04d}-{concern}.patch"
        produced.rename(final)
        entries.append(
            {
                "name": final.name,
                "concern": concern,
                "sha256": hashlib.sha256(final.read_bytes()).hexdigest(),
                "files": sorted(_files),
            }
        )
    (dest / "series").write_text("".join(e["name"] + "\n" for e in entries))
    manifest = {
        "name": "ddtree",
        "version": version,
        "created": "2026-11-29",
        "base": {"sglang": base.version, "tree": base.tree},
        "patches": entries,
    }
    (dest / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    shutil.rmtree(work)
    return dest


def rewritten_set(source: Path, dest: Path, patch: str, old: str, new: str) -> Path:
    """A copy of the set at `source` whose patch `patch` has `old` replaced by `new`, its
    manifest's sha256 updated to match (a set that passes the checksums, broken otherwise)."""
    import hashlib

    shutil.copytree(source, dest)
    path = dest / patch
    text = path.read_text()
    assert old in text, (patch, old)
    path.write_text(text.replace(old, new))
    manifest = yaml.safe_load((dest / "manifest.yaml").read_text())
    entry = next(e for e in manifest["patches"] if e["name"] == patch)
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (dest / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return dest


STUB = "python/sglang/srt/speculative/ddtree_stub.py"
VERSION_PY = "python/sglang/version.py"
INIT_PY = "python/sglang/__init__.py"


def build_test_patch_sets(root: Path) -> dict[str, Path]:
    """v1 (0.1.0): two patches (a new file, an edit); v2 (0.2.0): three (also edits __init__.py)."""
    v1 = make_patch_set(
        root / "0.1.0", "0.1.0", [("builder", {STUB: "VERSION = 1\n"}), ("wiring", {VERSION_PY: "+=# ddtree 0.1.0\n"})]
    )
    v2 = make_patch_set(
        root / "0.2.0",
        "0.2.0",
        [
            ("builder", {STUB: "VERSION = 2\n"}),
            ("wiring", {VERSION_PY: "+=# ddtree 0.2.0\n"}),
            ("extra", {INIT_PY: "+=# ddtree 0.2.0 extra\n"}),
        ],
    )
    return {"v1": v1, "v2": v2}
