"""Every YAML document is a pydantic model; a bad one is one line: `file: field: message`."""

from __future__ import annotations

import shutil

import pytest
import yaml

from deployer.errors import PatchSetError, RenderError
from deployer.locations import TEMPLATES_DIR
from deployer.patchset import load_patch_set
from deployer.patchset.overlay import load_overlay
from deployer.render.profiles import load_profiles
from patchset_fixtures import SMALL_CONCERNS

MANIFEST = {
    "name": "ddtree",
    "version": "0.1.0",
    "base": {"sglang": "0.5.23", "tree": "x"},
    "patches": [{"name": "p.patch", "sha256": "x"}],
}


@pytest.mark.parametrize(
    "change, expect",
    [
        ({"patches": [{"name": "p.patch"}]}, "manifest.yaml: patches.0.sha256: Field required"),
        (
            {"patches": [{"name": "../p.patch", "sha256": "x"}]},
            "patches.0.name: patch name '../p.patch' must be a plain",
        ),
        ({"base": "0.5.23"}, "manifest.yaml: base: Input should be a valid dictionary"),
        ({"colour": "red"}, "manifest.yaml: colour: Extra inputs are not permitted"),
        ({"version": None}, "manifest.yaml: version: Input should be a valid string"),
    ],
)
def test_a_bad_manifest_names_file_and_field(tmp_path, change, expect):
    (tmp_path / "manifest.yaml").write_text(yaml.safe_dump({**MANIFEST, **change}))
    (tmp_path / "series").write_text("p.patch\n")
    with pytest.raises(PatchSetError) as exc:
        load_patch_set(str(tmp_path))
    assert expect in str(exc.value) and str(tmp_path / "manifest.yaml") in str(exc.value)


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda d: d["concerns"][0].pop("title"), "concerns.yaml: concerns.0.title: Field required"),
        (lambda d: d["concerns"][1].update(id="Bad ID"), "concerns.1.id: concern id 'Bad ID' must be lower-case"),
        (lambda d: d["concerns"][0].update(files=["ok", ""]), "concerns.0.files: must be a list of non-empty strings"),
        (lambda d: d.update(concerns=[]), "concerns.yaml: concerns: List should have at least 1 item"),
        (lambda d: d["concerns"].append(dict(d["concerns"][0])), "concerns: ids must be unique, repeated: builder"),
    ],
)
def test_a_bad_concerns_file_names_file_and_field(tmp_path, edit, expect):
    doc = yaml.safe_load(yaml.safe_dump(SMALL_CONCERNS))
    edit(doc)
    (tmp_path / "concerns.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(PatchSetError, match="concerns.yaml") as exc:
        load_overlay(tmp_path)
    assert expect in str(exc.value)


@pytest.mark.parametrize(
    "name, edit, expect",
    [
        (
            "hardware.yaml",
            lambda d: next(iter(d.values())).pop("match"),
            "hardware.yaml: rtx-pro-6000-pcie.match: Field required",
        ),
        (
            "hardware.yaml",
            lambda d: next(iter(d.values())).update(unavailable_attention_backends=["fa3"]),
            "unavailable_attention_backends: Input should be a valid dictionary",
        ),
        (
            "topologies.yaml",
            lambda d: d["tp8"].update(valuez={}),
            "topologies.yaml: tp8.valuez: Extra inputs are not permitted",
        ),
        (
            "defaults.yaml",
            lambda d: d.update(tp_size={"a": 1}),
            "defaults.yaml: (top level): 'tp_size' must be a single value",
        ),
    ],
)
def test_a_bad_render_profile_names_file_and_field(tmp_path, name, edit, expect):
    shutil.copytree(TEMPLATES_DIR, tmp_path / "templates")
    path = tmp_path / "templates" / name
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(RenderError) as exc:
        load_profiles(tmp_path / "templates")
    assert expect in str(exc.value)


def test_the_shipped_documents_are_valid():
    assert load_profiles().topologies and load_patch_set("latest").patches
