"""Plugins: lazy lookup by name, third-party registration through real entry points, and
the error that lists the known names."""
from __future__ import annotations

import sys

import pytest

from engine import Engine
from engine.registry import PLACEMENTS, Registry, UnknownPluginError
from tests.conftest import install_entry_point

PLUGIN = '''
from engine.placements.resident import Resident

class Mirror(Resident):
    """A third-party placement: the resident strategy under another name."""
    name = "mirror"
'''


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """An installed-looking distribution declaring a placement in `moebench.placements`."""
    install_entry_point(tmp_path, monkeypatch, "mirror_plugin", PLUGIN, "moebench.placements", "mirror",
                        "mirror_plugin:Mirror")
    yield
    sys.modules.pop("mirror_plugin", None)


def test_entry_point_plugin_is_found(third_party, monkeypatch):
    fresh = Registry("placement", "moebench.placements", {"resident": "engine.placements.resident:Resident"})
    assert "mirror" in fresh.names()
    assert fresh.get("mirror").__name__ == "Mirror"
    # the scan adds to copies: after the test the registry is the one it was, without "mirror"
    monkeypatch.setattr(PLACEMENTS, "_targets", dict(PLACEMENTS._targets))
    monkeypatch.setattr(PLACEMENTS, "_loaded", dict(PLACEMENTS._loaded))
    monkeypatch.setattr(PLACEMENTS, "_scanned", False)
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="mirror")
    ref = Engine.from_pretrained("tiny-mixtral", device="cpu")
    assert eng.generate([[1, 2, 3]], 4).tokens == ref.generate([[1, 2, 3]], 4).tokens


def test_builtins_are_lazy_and_errors_list_names():
    reg = Registry("thing", "moebench.no-such-group", {"a": "engine.placements.cpu:CPUExperts"})
    assert reg._loaded == {}
    assert reg.get("a").name == "cpu"
    with pytest.raises(UnknownPluginError, match="unknown thing 'b'; known: a"):
        reg.get("b")
