"""What an installed kvgen carries: its data folders, its metadata, its license and its docs."""

import importlib.metadata
import importlib.resources
import tomllib
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent


def _pyproject():
    path = CHECKOUT / "pyproject.toml"
    if not path.exists():
        pytest.skip("needs the source checkout")
    return tomllib.loads(path.read_text())


def test_every_tuned_configs_folder_is_a_listed_package():
    # An unlisted folder of data files is what makes setuptools warn (BuildBackendWarning)
    # and, with a future setuptools, leave the files out of the wheel.
    tool = _pyproject()["tool"]["setuptools"]
    folders = [
        p
        for p in (CHECKOUT / "tuned_configs").iterdir()
        if p.is_dir() and not p.name.startswith("_")
    ]
    assert folders
    for folder in folders:
        name = f"kvgen.tuned_configs.{folder.name}"
        assert name in tool["packages"], f"{name} missing from pyproject's packages"
        # a GPU model's own files sit one folder down (tuned_configs/<arch>/<device>/)
        devices = [d for d in folder.iterdir() if d.is_dir()]
        want = ["*.json", "*/*.json"] if devices else ["*.json"]
        assert tool["package-data"].get(name) == want, name


def test_installed_package_carries_its_data_and_markers():
    root = importlib.resources.files("kvgen")
    assert root.joinpath("py.typed").is_file()
    configs = importlib.resources.files("kvgen.tuned_configs").joinpath("sm90")
    assert any(p.name.endswith(".json") for p in configs.iterdir())
    h100 = configs.joinpath("nvidia-h100-80gb-hbm3")
    assert any(p.name.endswith(".json") for p in h100.iterdir())
    templates = importlib.resources.files("kvgen.templates")
    assert templates.joinpath("mla_decode.py.j2").is_file()


def test_metadata_declares_numpy_license_and_the_formats():
    meta = importlib.metadata.metadata("kvgen")
    requires = importlib.metadata.requires("kvgen") or []
    numpy = [r for r in requires if r.startswith("numpy") and "extra" not in r]
    assert numpy and "<2.4" in numpy[0], requires  # Triton's interpreter needs it
    assert meta.get("License-Expression") == "Apache-2.0"
    # pip show -v / the index page: the README, then the byte formats
    description = meta.get_payload() or meta.get("Description", "")
    assert "# kvgen cache formats" in description and "row_bytes(L, G)" in description


def test_license_and_changelog_in_the_checkout():
    _pyproject()
    assert "Apache License" in (CHECKOUT / "LICENSE").read_text()
    assert "## " in (CHECKOUT / "CHANGELOG.md").read_text()
