"""Refuse patches that could write outside the checkout.

Every path a patch names (diff --git, ---/+++, rename/copy from/to) must be relative, free of
`..` and `.git` components; symlinks and submodules (modes 120000/160000) are refused. Hunk
bodies are skipped by counting their lines, so a removed line that starts with `-- ` is never
mistaken for a header.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from .errors import PathSafetyError

_HUNK = re.compile(rb"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_MODE = re.compile(rb"^(new file mode|deleted file mode|old mode|new mode|index [0-9a-f]+\.\.[0-9a-f]+) ?(\d{6})?")
_FORBIDDEN_MODES = {b"120000": "a symlink", b"160000": "a submodule"}
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "r": "\r", "v": "\v"}


def unquote_git_path(raw: str) -> str:
    """Undo git's C-style quoting of a path ("a/sp ace\\303\\251")."""
    if not (raw.startswith('"') and raw.endswith('"') and len(raw) >= 2):
        return raw
    body, out, i = raw[1:-1], bytearray(), 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if re.match(r"[0-7]{3}", body[i + 1:i + 4]):
                out.append(int(body[i + 1:i + 4], 8))
                i += 4
                continue
            out += _ESCAPES.get(nxt, nxt).encode()
            i += 2
            continue
        out += ch.encode()
        i += 1
    return out.decode("utf-8", errors="surrogateescape")


def _split_diff_git(rest: str) -> list[str]:
    """Split the `a/X b/Y` part of a `diff --git` line into its two (possibly quoted) paths."""
    if rest.startswith('"'):
        end = re.match(r'"(?:[^"\\]|\\.)*"', rest)
        if not end:
            return [rest]
        first, second = end.group(0), rest[end.end():].strip()
        return [first, second]
    if rest.endswith('"'):
        start = rest.rfind(' "')
        return [rest[:start], rest[start + 1:]]
    # Unquoted and symmetric: "a/P b/P" -> split in the middle.
    half = (len(rest) - 1) // 2
    if len(rest) % 2 == 1 and rest[half] == " " and rest[:half][2:] == rest[half + 1:][2:]:
        return [rest[:half], rest[half + 1:]]
    return rest.split(" b/", 1) if " b/" in rest else [rest]


def check_path(path: str, *, patch: str, strip_prefix: bool) -> str:
    """Return the repository-relative path, or raise PathSafetyError naming patch and path."""
    p = unquote_git_path(path.strip())
    if p == "/dev/null":
        return p
    if strip_prefix:
        if p.startswith("/"):
            raise PathSafetyError(f"patch {patch}: absolute path {p!r} is refused")
        if "/" in p:
            p = p.split("/", 1)[1]
    if not p or "\x00" in p or "\\" in p:
        raise PathSafetyError(f"patch {patch}: malformed path {path!r} is refused")
    if p.startswith("/"):
        raise PathSafetyError(f"patch {patch}: absolute path {p!r} is refused")
    parts = PurePosixPath(p).parts
    if any(part == ".." for part in parts) or "/../" in f"/{p}/":
        raise PathSafetyError(f"patch {patch}: path {p!r} escapes the checkout ('..')")
    if any(part.lower() == ".git" for part in parts):
        raise PathSafetyError(f"patch {patch}: path {p!r} is inside .git/")
    return p


def patch_paths(data: bytes, *, patch: str) -> list[str]:
    """Every path the patch touches, in order of first mention; raises on any unsafe one."""
    seen: dict[str, None] = {}
    lines = data.split(b"\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        hunk = _HUNK.match(line)
        if hunk:
            old = int(hunk.group(1)) if hunk.group(1) is not None else 1
            new = int(hunk.group(2)) if hunk.group(2) is not None else 1
            i += 1
            while (old > 0 or new > 0) and i < len(lines):
                body = lines[i]
                if body.startswith(b"\\"):
                    i += 1
                    continue
                tag = body[:1]
                if tag in (b" ", b""):
                    old, new = old - 1, new - 1
                elif tag == b"-":
                    old -= 1
                elif tag == b"+":
                    new -= 1
                else:
                    break
                i += 1
            continue
        text = line.decode("utf-8", errors="surrogateescape")
        found: list[tuple[str, bool]] = []
        if text.startswith("diff --git "):
            found = [(p, True) for p in _split_diff_git(text[len("diff --git "):])]
        elif text.startswith("--- ") or text.startswith("+++ "):
            found = [(text[4:].split("\t")[0], True)]
        elif text.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            found = [(text.split(" ", 2)[2], False)]
        else:
            mode = _MODE.match(line)
            if mode and mode.group(2) in _FORBIDDEN_MODES:
                raise PathSafetyError(
                    f"patch {patch}: creates or changes {_FORBIDDEN_MODES[mode.group(2)]} "
                    f"(mode {mode.group(2).decode()}); refused")
        for raw, strip in found:
            p = check_path(raw, patch=patch, strip_prefix=strip)
            if p != "/dev/null":
                seen.setdefault(p, None)
        i += 1
    return list(seen)
