"""The CLI skips Hydra's first composition (`Hydra.get_mode`, which composes the whole config only
to read `hydra.mode`) exactly where its answer is known: moebench's own config, every experiment
included, never sets the mode, and a command that could set it otherwise is left to Hydra."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra._internal.hydra import Hydra

from harness.cli import CONF_DIR, mode_from_flags, mode_settable
from harness.plan import composer

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))


def test_no_config_of_moebench_sets_the_mode() -> None:
    assert EXPERIMENTS
    with composer(hydra=True) as compose:
        for overrides in ([], *([f"experiment={name}"] for name in EXPERIMENTS)):
            assert compose(overrides).hydra.mode is None, overrides


@pytest.mark.parametrize("argv,settable", [
    (["workload=chat"], False),
    (["-m", "placement=resident,cpu", "run.repeats=2"], False),
    (["experiment=placement_sweep"], False),
    (["hydra.mode=MULTIRUN"], True),
    (["+hydra.mode=RUN"], True),
    (["hydra.searchpath=[file:///tmp/conf]", "experiment=mine"], True),
    (["-cp", "/tmp/conf"], True),
    (["--config-name", "other"], True),
])
def test_the_mode_is_left_to_hydra_where_the_command_line_could_set_it(argv, settable) -> None:
    assert mode_settable(argv) is settable
    asked = Hydra.get_mode
    with mode_from_flags(argv):
        assert (Hydra.get_mode is asked) is settable
        if not settable:
            assert Hydra.get_mode(None, "config", argv) is None
    assert Hydra.get_mode is asked
