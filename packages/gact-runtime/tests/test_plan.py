"""BitPlan: widths and seeds per save-site key, and what it caches of them."""

from __future__ import annotations

import hashlib
import math

import pytest
from gact import GactConfig
from gact.plan import BitPlan, mix_seed


def _splitmix_fold(*parts: int) -> int:
    """NOTE [Seeds] written out once more, independently of ``mix_seed``."""
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = ((h ^ (part & mask)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & mask
        h ^= h >> 29
    return h


def test_mix_seed_continues_a_fold_from_its_start() -> None:
    parts = (7, 2**63 + 5, 0, 123456789)
    assert mix_seed(*parts) == _splitmix_fold(*parts)
    for cut in range(len(parts) + 1):
        assert mix_seed(*parts[cut:], start=mix_seed(*parts[:cut])) == mix_seed(*parts)


def test_seeds_follow_the_step_and_the_configured_seed() -> None:
    """The per-step part of the seed is cached; it must change with the step and the seed."""
    plan = BitPlan(GactConfig.from_level("L1", seed=3))
    key = "layer.0#1:float32:2d"
    key_hash = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    seen = set()
    for step, seed in [(0, 3), (0, 3), (1, 3), (5, 3), (5, 11), (2, 11)]:
        plan.step = step
        if seed != plan.config.seed:
            plan.config = plan.config.replace(seed=seed)
        for occurrence in range(3):
            got = plan.seed_for(key, occurrence)
            assert got == _splitmix_fold(seed, step, key_hash, occurrence)
            seen.add(got)
    assert len(seen) == 5 * 3  # (0, 3) twice: the same seeds


@pytest.mark.parametrize(("first", "second"), [("L1", "L2.2"), ("L2", "L1.2"), ("L2.2", "L2")])
def test_widths_follow_a_changed_configuration(first: str, second: str) -> None:
    plan = BitPlan(GactConfig.from_level(first))
    plan.config = GactConfig.from_level(second)
    cfg = plan.config
    expected = cfg.bits if cfg.bits is not None else math.ceil(cfg.avg_bits - cfg.overhead_bits)
    assert plan.default_bits == expected
    assert plan.bits_for("never-allocated") == expected
    plan.bits["allocated"] = 7
    fixed = cfg.bits is not None
    assert plan.bits_for("allocated") == (expected if fixed else 7)
    assert plan.allocated("allocated") is (not fixed)
