from __future__ import annotations

import gact
import pytest
from gact import LEVELS, ConfigError, GactConfig


def test_level_table_matches_the_documented_meanings() -> None:
    assert [lvl for lvl in LEVELS] == ["L0", "L1", "L1.1", "L1.2", "L2", "L2.1", "L2.2", "L3"]
    assert (LEVELS["L1"].bits, LEVELS["L1.1"].bits, LEVELS["L1.2"].bits) == (4, 8, 2)
    assert (LEVELS["L2"].avg_bits, LEVELS["L2.1"].avg_bits, LEVELS["L2.2"].avg_bits) == (4, 3, 2)
    assert LEVELS["L3"].swap and LEVELS["L3"].adaptive and not LEVELS["L2"].swap
    assert not LEVELS["L0"].compresses


def test_unknown_level_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown optimization level 'L9'.*L0, L1, L1.1"):
        GactConfig(level="L9")
    with pytest.raises(ValueError, match=r"L2\.2"):
        gact.set_optimization_level("bogus")


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['bitz'\].*adapt_interval"):
        GactConfig.from_level("L2", bitz=3)


@pytest.mark.parametrize(
    "field, value",
    [
        ("group_size", 100),
        ("min_numel", -1),
        ("adapt_interval", 0),
        ("num_probes", 1),
        ("num_probes", 2.5),
        ("sensitivity_momentum", 1.0),
        ("seed", -1),
        ("sensitivity_method", "subset"),
        ("sensitivity_momentum", "0.5"),
        ("sensitivity_momentum", True),
        ("seed", True),
        ("seed", 2**64),
        ("min_numel", True),
        ("min_numel", 10.0),
        ("adapt_interval", True),
        ("group_size", 256.0),
        ("compress_checkpoint_inputs", 1),
        ("channel_groups", "yes"),
        ("rotated_groups", 1),
        ("adapt_budget", -0.1),
        ("adapt_budget", float("inf")),
        ("adapt_budget", "none"),
    ],
)
def test_invalid_option_values_raise(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        GactConfig.from_level("L2", **{field: value})


def test_failed_set_optimization_level_keeps_the_previous_default() -> None:
    before = gact.get_config()
    with pytest.raises(ValueError):
        gact.set_optimization_level("L7")
    assert gact.get_config() == before


def test_set_optimization_level_is_the_default_of_new_controllers() -> None:
    import torch

    before = gact.get_config()
    try:
        gact.set_optimization_level("L1.2", min_numel=0)
        controller = gact.Controller(torch.nn.Linear(2, 2))
        assert controller.config.level == "L1.2" and controller.config.min_numel == 0
    finally:
        gact.set_optimization_level(before.level, min_numel=before.min_numel)


def test_metadata_budget() -> None:
    assert GactConfig(group_size=256).overhead_bits == 0.25
    assert GactConfig(group_size=128).overhead_bits == 0.5


def test_budget_that_metadata_alone_exceeds_is_refused_up_front() -> None:
    # L2.2 averages 2 bits with metadata; groups of 32 cost 2 bits of metadata per element
    with pytest.raises(ConfigError, match=r"group_size >= 64"):
        GactConfig.from_level("L2.2", group_size=32)
    assert GactConfig.from_level("L2.2", group_size=64).overhead_bits == 1.0
    assert GactConfig.from_level("L1.2", group_size=32).bits == 2  # fixed widths are not budgets
