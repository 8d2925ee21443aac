"""Which filesystem a path is on (type and mount point), from /proc/self/mountinfo: what an error
about that filesystem (the lock's, when it has no flock support) must name."""

import os


MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as a 3-digit octal escape."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def _parse(line: str):
    """(mount point, filesystem type) of one mountinfo line, or None when it has no `-` separator."""
    fields = line.split()
    if "-" not in fields[6:]:
        return None
    sep = fields.index("-", 6)
    if len(fields) < 5 or len(fields) <= sep + 1:
        return None
    return _unescape(fields[4]), fields[sep + 1]


def _covers(mount_point: str, path: str) -> bool:
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def mount_of(path: str, mountinfo: str = MOUNTINFO):
    """(filesystem type, mount point) of the mount `path` is on, or None when mountinfo cannot be
    read (not Linux, no /proc). The deepest mount point wins; of two at one point, the later (on top)."""
    try:
        with open(mountinfo, errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    real, best = os.path.realpath(path), None
    for line in lines:
        found = _parse(line)
        if found and _covers(found[0], real) and (best is None or len(found[0]) >= len(best[0])):
            best = found
    return best and (best[1], best[0])


def describe_mount(path: str) -> str:
    """`nfs4, mounted at /srv`, or what is known when the mount cannot be found."""
    found = mount_of(path)
    if found is None:
        return "filesystem type unknown (%s unreadable)" % MOUNTINFO
    return "%s, mounted at %s" % found
