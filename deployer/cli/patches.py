"""`ddeploy base fetch` and `ddeploy patches export|verify|list|show|diff|restore|archive`.

Human output goes to stderr, `--json` and patch-diff text to stdout. Released sets live under
$DDEPLOY_PATCHES_DIR/ddtree (default: the project's patches/ddtree), the overlay is
$DDEPLOY_OVERLAY_DIR (default: the project's overlays/ddtree).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import ConflictError, OverlayTestsFailed, PatchSetError
from ..locations import active_overlay_dir
from .app import cli
from .output import emit_json, say, table

if TYPE_CHECKING:  # the patch-set modules load when a command runs, not for --help
    from ..patchset.release import PatchSet
    from ..patchset.verify import VerifyReport


def _overlay(path: str | None) -> Path:
    return Path(path) if path else active_overlay_dir()


def _set_json(ps: PatchSet) -> dict:
    return {
        "name": ps.name,
        "version": ps.version,
        "created": ps.created,
        "path": str(ps.path),
        "base": {"sglang": ps.base_version, "tree": ps.base_tree},
        "fingerprint": ps.fingerprint(),
        "patches": [
            {"name": p.name, "concern": p.concern, "sha256": p.sha256, "files": list(p.files)} for p in ps.patches
        ],
    }


@cli.group()
def base() -> None:
    """The pristine SGLang base (a git repository built from the PyPI wheel)."""


@base.command("fetch")
@click.option("--rebuild", is_flag=True, help="Build it again from the wheel even if cached.")
def base_fetch(rebuild: bool) -> None:
    """Build (once) and verify the pristine SGLang base in the cache."""
    from ..patchset.sglang_base import fetch_base

    b = fetch_base(rebuild=rebuild)
    say(f"SGLang {b.version} base at {b.path} (commit {b.commit[:12]}, tree {b.tree}) verified")


@cli.group()
def patches() -> None:
    """Versioned DDTree patch sets: export, verify, list, show, diff, restore, archive."""


@patches.command("export")
@click.option("--version", "version", help="Version to release (default: next patch version).")
@click.option("--date", help="The manifest's created date, YYYY-MM-DD (default: $SOURCE_DATE_EPOCH, else today UTC).")
@click.option("--overlay", type=click.Path(file_okay=False, exists=True), help="Overlay directory.")
def patches_export(version: str | None, date: str | None, overlay: str | None) -> None:
    """Release the overlay as a new, immutable patch set."""
    from ..patchset.export import export_patch_set
    from ..patchset.release import sets_root

    result = export_patch_set(_overlay(overlay), sets_root(), version=version, date=date)
    for p in result.patches:
        say(f"{p.name}: {p.concern}, {len(p.files)} file(s)")
    for cid in result.skipped:
        say(f"skipped concern {cid}: nothing in the overlay")
    say(f"released {result.version} at {result.path}")


def _print_verify(report: VerifyReport) -> None:
    say(f"verifying {report.ident} against {report.against}")
    for r in report.results:
        say(r.line())
    if report.reversed_ok is not None:
        say(
            "git apply -R --check: every patch applied; reversed to the base tree exactly"
            if report.reversed_ok
            else f"git apply -R --check: FAILED: {report.reverse_detail}"
        )
    if report.tests is not None:
        if not report.tests.passed:
            click.echo(report.tests.output[-4000:], err=True)
        say(f"overlay tests in the patched tree: {report.tests.summary}")
    elif report.tests_note:
        say(report.tests_note)


def _raise_verify_failure(report: VerifyReport) -> None:
    if report.conflict is not None:
        c = report.conflict
        raise ConflictError(
            f"patch {c.name} of {report.ident} does not apply strictly ({', '.join(c.files)}); "
            f"nothing was changed; refresh the overlay against the base and export a new version"
        )
    if not report.reversed_ok:
        raise PatchSetError(f"{report.ident}: {report.reverse_detail}")
    if report.tests is not None and not report.tests.passed:
        raise OverlayTestsFailed(f"{report.ident}: overlay tests failed in the patched tree ({report.tests.summary})")


@patches.command("verify")
@click.argument("version", required=False)
@click.option("--no-tests", is_flag=True, help="Skip the overlay's tests in the patched tree.")
@click.option(
    "--against",
    type=click.Path(file_okay=False, exists=True),
    help="A git checkout to apply to instead of the pristine base (cloned, never changed).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def patches_verify(version: str | None, no_tests: bool, against: str | None, as_json: bool) -> None:
    """Check checksums, apply strictly to a fresh base clone, confirm, run the overlay tests."""
    from ..patchset.release import load_patch_set
    from ..patchset.verify import verify_patch_set

    ps = load_patch_set(version)
    report = verify_patch_set(ps, against=Path(against) if against else None, run_tests=not no_tests)
    _print_verify(report)
    if as_json:
        emit_json(
            {
                "set": report.ident,
                "ok": report.ok,
                "patches": [r.__dict__ for r in report.results],
                "reversed_ok": report.reversed_ok,
                "tests": None
                if report.tests is None
                else {"returncode": report.tests.returncode, "summary": report.tests.summary},
            }
        )
    _raise_verify_failure(report)
    say(f"{report.ident}: OK")


def _load_all() -> tuple[list[PatchSet], dict[str, str]]:
    """Every released set; a broken one is reported by version instead of hiding the others."""
    from ..patchset.release import list_versions, load_patch_set, sets_root

    sets, broken = [], {}
    for v in list_versions(root=sets_root()):
        try:
            sets.append(load_patch_set(v))
        except PatchSetError as exc:
            broken[v] = str(exc)
    return sets, broken


def _archived_json(record, restored: Path | None) -> dict:
    fields = ("version", "created", "tag", "commit", "manifest_sha256")
    return {**{k: getattr(record, k) for k in fields}, "archived": True, "restored": restored and str(restored)}


def _archived() -> list[tuple]:
    """(record, its restored copy or None) for every release archived outside the window."""
    from ..patchset.archive import read_archive, restored_copy
    from ..patchset.release import sets_root

    return [(r, restored_copy(r)) for r in read_archive(sets_root()).values()]


def _list_rows(sets: list[PatchSet], broken: dict[str, str], archived: list[tuple]) -> list[list[str]]:
    from ..patchset.release import version_key

    rows = [
        [ps.version, ps.created, f"sglang {ps.base_version}", ps.base_tree[:12], str(len(ps.patches))] for ps in sets
    ]
    rows += [[r.version, r.created, "restored" if at else "archived", r.tag, "-"] for r, at in archived]
    rows.sort(key=lambda row: version_key(row[0]))
    return rows + [[v, "INVALID", "-", "-", "-"] for v in broken]


@patches.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
def patches_list(as_json: bool) -> None:
    """Released versions with their dates, base and patch count; archived ones with their tag."""
    from ..patchset.release import sets_root

    sets, broken = _load_all()
    archived = _archived()
    if as_json:
        emit_json(
            [{**_set_json(ps), "archived": False} for ps in sets]
            + [_archived_json(r, at) for r, at in archived]
            + [{"version": v, "error": e} for v, e in broken.items()]
        )
    elif sets or broken or archived:
        say(table(_list_rows(sets, broken, archived), ["version", "created", "base", "base tree", "patches"]))
        if archived:
            say("archived: outside the release window, kept in git; restore one with `ddeploy patches restore VERSION`")
    else:
        say(f"no released patch sets under {sets_root()}")
    if broken:
        raise PatchSetError(
            f"{len(broken)} released set(s) failed verification: " + "; ".join(f"{v}: {e}" for v, e in broken.items())
        )


@patches.command("show")
@click.argument("version")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
def patches_show(version: str, as_json: bool) -> None:
    """The patches of one set: concern, files and sha256."""
    from ..patchset.release import load_patch_set

    ps = load_patch_set(version)
    if as_json:
        emit_json(_set_json(ps))
        return
    say(f"{ps.ident} created {ps.created}, base SGLang {ps.base_version} tree {ps.base_tree}")
    for p in ps.patches:
        say(f"{p.name}  concern={p.concern}  sha256={p.sha256}")
        for f in p.files:
            say(f"    {f}")


@patches.command("diff")
@click.argument("old")
@click.argument("new")
@click.option("--stat", is_flag=True, help="Only the per-patch summary, no patch text.")
def patches_diff(old: str, new: str, stat: bool) -> None:
    """What changed between two released sets, per patch."""
    from ..patchset.compare import UNCHANGED, diff_sets
    from ..patchset.release import load_patch_set

    a, b = load_patch_set(old), load_patch_set(new)
    for change in diff_sets(a, b):
        say(change.summary())
        if not stat and change.status != UNCHANGED:
            click.echo(change.unified(a.version, b.version), nl=False)


@patches.command("restore")
@click.argument("version")
def patches_restore(version: str) -> None:
    """Bring an archived release back from its git tag (else its recorded commit), verified."""
    from ..patchset.archive import restore_release
    from ..patchset.release import load_patch_set

    restored = restore_release(version)
    ps = load_patch_set(restored.path)
    what = f"ddtree {ps.version} ({len(ps.patches)} patches, checksums verified)"
    if restored.source is None:
        say(f"{what} is already at {restored.path}")
    else:
        say(f"restored {what} from {restored.source}: {restored.path}")


@patches.command("archive")
def patches_archive() -> None:
    """Apply the release window: tag every release, archive those outside it, bring back pinned ones."""
    from ..patchset.archive import WINDOW, apply_window

    change = apply_window()
    for v in change.tagged:
        say(f"tagged ddtree-{v}")
    for v in change.archived:
        say(f"archived {v}: removed from the tree, recorded in archive.yaml (tag ddtree-{v})")
    for v in change.returned:
        say(f"returned {v} to the tree (a host file pins it)")
    if not (change.archived or change.returned):
        say(f"the tree already holds the window (the newest {WINDOW} releases and the pinned ones)")
