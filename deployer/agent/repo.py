"""The checkout's git repository: commands with a fixed environment, and objects looked up in
one `git cat-file --batch`."""

import os
import subprocess

from .common import Fail, IDENTITY


class Repo:
    def __init__(self, path: str):
        self.path = path
        self.gitdir = os.path.join(path, ".git")
        self.ddir = os.path.join(self.gitdir, "ddeploy")

    def env(self, env=None) -> dict:
        full = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        full.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "GIT_OPTIONAL_LOCKS": "0"})
        full.update(IDENTITY)
        full.update(env or {})
        return full

    def run(self, *args, input=None, env=None, check=True):
        proc = subprocess.run(
            ["git", "--literal-pathspecs", "-C", self.path] + list(args),
            input=input,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env(env),
        )
        if check and proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise Fail(
                "RemoteCommandError",
                "git %s failed in %s: %s" % (args[0], self.path, err[-1] if err else proc.returncode),
            )
        return proc

    def out(self, *args, **kw) -> str:
        return self.run(*args, **kw).stdout.decode(errors="replace").strip()

    def rev(self, spec: str):
        p = self.run("rev-parse", "-q", "--verify", spec, check=False)
        return p.stdout.decode().strip() or None

    def objects(self, names: list, more=None) -> list:
        """Look up objects by name (`HEAD^{tree}`, `REV:path`; no newline in a name) in one
        `git cat-file --batch` process: [(id, type, content), or None where `rev-parse --verify`
        finds nothing]. more(the answers so far) may return further names, then asked of the same
        process (cat-file answers each name as it reads it)."""
        p = subprocess.Popen(
            ["git", "--literal-pathspecs", "-C", self.path, "cat-file", "--batch"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.env(),
        )
        found, asked = [], 0
        try:
            while names:
                asked += len(names)
                p.stdin.write("".join(n + "\n" for n in names).encode())
                p.stdin.flush()
                for _ in names:
                    header = p.stdout.readline().split()  # `<id> <type> <size>`, or `<name> missing`
                    if len(header) == 3 and header[2].isdigit():
                        content = p.stdout.read(int(header[2]) + 1)[:-1]
                        found.append((header[0].decode(), header[1].decode(), content))
                    else:
                        found.append(None)
                names, more = (more(found) if more else []), None
        except OSError:  # git is gone (a broken repository): what it did not answer was not found
            pass
        finally:
            for pipe in (p.stdin, p.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
            p.wait()
        return found + [None] * (asked - len(found))

    def exists(self, obj: str) -> bool:
        return self.run("cat-file", "-e", obj, check=False).returncode == 0

    def branch(self):
        p = self.run("symbolic-ref", "-q", "--short", "HEAD", check=False)
        return p.stdout.decode().strip() or None

    def diff_names(self, a: str, b: str) -> list:
        return [f for f in self.out("diff", "--no-renames", "--name-only", "-z", a, b).split("\0") if f]

    def dirty(self, files=None) -> list:
        """Paths whose index or work tree differ from HEAD, or untracked among `files`."""
        args = ["status", "--porcelain", "-z", "--no-renames"]
        if files is not None:
            if not files:
                return []
            args += ["--untracked-files=all", "--"] + sorted(files)
        else:
            args += ["--untracked-files=no"]
        raw = self.run(*args).stdout.decode(errors="replace")
        return sorted({e[3:] for e in raw.split("\0") if len(e) > 3})
