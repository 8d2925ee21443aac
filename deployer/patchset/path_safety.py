"""Refuse patches that could write outside the checkout.

Every path a patch names (diff --git, ---/+++, rename/copy from/to) must be relative, free of
`..` and `.git` components; symlinks and submodules (modes 120000/160000) are refused. The
scanner reads a patch the way `git apply` does: hunk bodies are skipped by counting their lines
(so a removed line that starts with `-- ` is never mistaken for a header) and binary payloads are
skipped whole; everything else that looks like a header is checked, commit message included,
because `git apply` would treat it as one too.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from ..errors import PathSafetyError

_HUNK = re.compile(rb"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_MODE = re.compile(
    rb"^(?:new file mode|deleted file mode|old mode|new mode|index [0-9a-f]+\.\.[0-9a-f]+) ?(\d{6})?\s*$"
)
_FORBIDDEN_MODES = {b"120000": "a symlink", b"160000": "a submodule"}
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "r": "\r", "v": "\v"}
_PLAIN_HEADERS = ("rename from ", "rename to ", "copy from ", "copy to ")


def unquote_git_path(raw: str) -> str:
    """Undo git's C-style quoting of a path ("a/sp ace\\303\\251")."""
    if not (raw.startswith('"') and raw.endswith('"') and len(raw) >= 2):
        return raw
    body, out, i = raw[1:-1], bytearray(), 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            if re.match(r"[0-7]{3}", body[i + 1 : i + 4]):
                out.append(int(body[i + 1 : i + 4], 8))
                i += 4
                continue
            out += _ESCAPES.get(body[i + 1], body[i + 1]).encode()
            i += 2
            continue
        out += ch.encode()
        i += 1
    return out.decode("utf-8", errors="surrogateescape")


def split_diff_git(rest: str) -> list[str]:
    """Split the `a/X b/Y` part of a `diff --git` line into its two (possibly quoted) paths."""
    if rest.startswith('"'):
        end = re.match(r'"(?:[^"\\]|\\.)*"', rest)
        if not end:
            return [rest]
        return [end.group(0), rest[end.end() :].strip()]
    if rest.endswith('"'):
        start = rest.rfind(' "')
        return [rest[:start], rest[start + 1 :]] if start > 0 else [rest]
    # Unquoted and symmetric ("a/P b/P", P may contain spaces): split in the middle.
    half = (len(rest) - 1) // 2
    if len(rest) % 2 == 1 and rest[half] == " " and rest[:half][2:] == rest[half + 1 :][2:]:
        return [rest[:half], rest[half + 1 :]]
    if " b/" in rest:
        first, second = rest.split(" b/", 1)
        return [first, "b/" + second]
    return [rest]


def check_path(path: str, *, patch: str, strip_prefix: bool) -> str:
    """Return the repository-relative path, or raise PathSafetyError naming patch and path."""
    p = unquote_git_path(path.strip())
    if p == "/dev/null":
        return p
    if p.startswith("/"):
        raise PathSafetyError(f"patch {patch}: absolute path {p!r} is refused")
    if strip_prefix and "/" in p:
        p = p.split("/", 1)[1]  # the a/ or b/ prefix (any one component, as git apply -p1)
    if not p or "\x00" in p or "\\" in p or "\n" in p:
        raise PathSafetyError(f"patch {patch}: malformed path {path.strip()!r} is refused")
    if p.startswith("/"):
        raise PathSafetyError(f"patch {patch}: absolute path {p!r} is refused")
    parts = PurePosixPath(p).parts
    if ".." in parts or "/../" in f"/{p}/":
        raise PathSafetyError(f"patch {patch}: path {p!r} escapes the checkout ('..')")
    if any(part.lower() == ".git" for part in parts):
        raise PathSafetyError(f"patch {patch}: path {p!r} is inside .git/")
    return p


def _skip_hunk(lines: list[bytes], i: int, old: int, new: int) -> int:
    """Index of the first line after a hunk body whose header announced old/new line counts."""
    while (old > 0 or new > 0) and i < len(lines):
        tag = lines[i][:1]
        if tag == b"\\":  # "\ No newline at end of file"
            pass
        elif tag in (b" ", b""):
            old, new = old - 1, new - 1
        elif tag == b"-":
            old -= 1
        elif tag == b"+":
            new -= 1
        else:
            break  # a short hunk: let the caller read this line as a header
        i += 1
    while i < len(lines) and lines[i].startswith(b"\\"):
        i += 1
    return i


def _skip_binary(lines: list[bytes], i: int) -> int:
    """Skip a `GIT binary patch` payload: `literal|delta N` + base85 lines, blank, twice."""
    for _ in range(2):
        if i < len(lines) and re.match(rb"^(literal|delta) \d+$", lines[i]):
            i += 1
            while i < len(lines) and lines[i].strip():
                i += 1
            i += 1
    return i


def _header_paths(lines: list[bytes], i: int) -> tuple[list[tuple[str, bool]], int]:
    """Paths named by the header line at i (and how many lines it spans)."""
    text = lines[i].decode("utf-8", errors="surrogateescape")
    if text.startswith("diff --git "):
        return [(p, True) for p in split_diff_git(text[len("diff --git ") :])], 1
    if text.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ "):
        nxt = lines[i + 1].decode("utf-8", errors="surrogateescape")
        return [(text[4:].split("\t")[0], True), (nxt[4:].split("\t")[0], True)], 2
    if text.startswith(_PLAIN_HEADERS):
        return [(text.split(" ", 2)[2], False)], 1
    return [], 1


def _check_mode(line: bytes, patch: str) -> None:
    mode = _MODE.match(line)
    if mode and mode.group(1) in _FORBIDDEN_MODES:
        raise PathSafetyError(
            f"patch {patch}: creates or changes {_FORBIDDEN_MODES[mode.group(1)]} "
            f"(mode {mode.group(1).decode()}); refused"
        )


def _header_lines(data: bytes):
    """(index, line) of every header line, as `git apply` reads them (hunk bodies and binary
    payloads skipped)."""
    lines = data.split(b"\n")
    i = 0
    while i < len(lines):
        line = lines[i].rstrip(b"\r")
        hunk = _HUNK.match(line)
        if hunk:
            old = int(hunk.group(1)) if hunk.group(1) is not None else 1
            new = int(hunk.group(2)) if hunk.group(2) is not None else 1
            i = _skip_hunk(lines, i + 1, old, new)
            continue
        if line == b"GIT binary patch":
            i = _skip_binary(lines, i + 1)
            continue
        yield i, lines
        i += 1


def patch_paths(data: bytes, *, patch: str) -> list[str]:
    """Every path the patch touches, in order of first mention; raises on any unsafe one."""
    seen: dict[str, None] = {}
    skip_until = 0
    for i, lines in _header_lines(data):
        if i < skip_until:
            continue
        line = lines[i].rstrip(b"\r")
        _check_mode(line, patch)
        found, span = _header_paths(lines, i)
        for raw, strip in found:
            p = check_path(raw.rstrip("\r"), patch=patch, strip_prefix=strip)
            if p != "/dev/null":
                seen.setdefault(p, None)
        skip_until = i + span
    return list(seen)


_INDEX = re.compile(rb"^index ([0-9a-f]{7,64})\.\.([0-9a-f]{7,64})(?: \d{6})?\s*$")
_ZERO_BLOB = re.compile(r"^0+$")


def patch_preimages(data: bytes, *, patch: str) -> dict[str, str | None]:
    """The blob each file must hold before this patch applies, from its `index` lines:
    {path: blob id (possibly abbreviated), or None where the patch creates the file}. Files
    whose diff has no index line (a plain diff) are left out: only `git apply` can judge them.
    """
    out: dict[str, str | None] = {}
    current: list[str] = []
    for i, lines in _header_lines(data):
        line = lines[i].rstrip(b"\r")
        text = line.decode("utf-8", errors="surrogateescape")
        if text.startswith("diff --git "):
            raw = split_diff_git(text[len("diff --git ") :])
            current = [check_path(r, patch=patch, strip_prefix=True) for r in raw]
            continue
        index = _INDEX.match(line)
        if index and current:
            old = index.group(1).decode()
            src = current[0]
            out.setdefault(src, None if _ZERO_BLOB.match(old) else old)
            if len(current) > 1 and current[1] != src:  # a rename or copy: the target must be new
                out.setdefault(current[1], None)
            current = []
    return out
