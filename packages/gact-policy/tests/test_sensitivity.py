"""Estimators recover closed-form sensitivities of synthetic linear models."""

import tracemalloc

import numpy as np
import pytest
from gact_policy import (
    SENSITIVITY_CAP,
    LinearNoiseModel,
    ProbeConfig,
    SensitivityEstimate,
    min_pair_probes,
    pairwise_sensitivity,
    probe_sensitivity,
)


@pytest.fixture(scope="module")
def model() -> LinearNoiseModel:
    return LinearNoiseModel.random(n_items=15, dim=3000, seed=3, spread=1.0)


def rel_err(est: np.ndarray, true: np.ndarray) -> float:
    return float(np.median(np.abs(est / true - 1.0)))


def test_probe_config_validation() -> None:
    with pytest.raises(ValueError):
        ProbeConfig(np.array([1, 2]), np.array([1], dtype=np.uint64))
    with pytest.raises(ValueError):
        ProbeConfig(np.array([0]), np.array([1], dtype=np.uint64))
    with pytest.raises(ValueError):
        ProbeConfig(np.array([2]), np.array([1], dtype=np.int32))
    cfg = ProbeConfig(np.array([2, 3]), np.array([1, 2], dtype=np.uint64))
    with pytest.raises(ValueError):
        cfg.bits[0] = 5  # read-only
    assert cfg.with_bits([0], [8]).bits.tolist() == [8, 3]


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_reference_recovers_c(model: LinearNoiseModel, bits: int) -> None:
    est = probe_sensitivity(model, np.full(15, bits), seed=1)
    # ||g0 - g_l||² / (2 S) has relative std about sqrt(2 / D_eff); D_eff >= ~1000 here.
    assert rel_err(est, model.sensitivity) < 0.08
    assert np.all(np.abs(est / model.sensitivity - 1) < 0.35)


def test_robust_variant_is_consistent_and_conservative(model: LinearNoiseModel) -> None:
    est = probe_sensitivity(model, np.full(15, 2), robust=True, seed=2)
    ratio = est / model.sensitivity
    assert 0.95 < np.median(ratio) < 1.2
    assert np.all(ratio > 0.7)


def test_pairwise_recovers_c_and_improves_with_probes(model: LinearNoiseModel) -> None:
    true = model.sensitivity
    kmin = min_pair_probes(15)
    errs = []
    for k in (kmin, 12, 30):
        trials = [
            rel_err(pairwise_sensitivity(model, np.full(15, 2), num_probes=k, seed=s), true)
            for s in range(4)
        ]
        errs.append(float(np.mean(trials)))
    assert errs[0] < 0.5
    assert errs[-1] < 0.15
    assert errs[-1] < errs[0]


def test_pairwise_probe_count() -> None:
    assert [min_pair_probes(n) for n in (0, 1, 3, 4, 150)] == [2, 2, 3, 4, 18]
    calls = []

    def grad(cfg: ProbeConfig) -> np.ndarray:
        calls.append(cfg)
        return np.zeros(4)

    pairwise_sensitivity(grad, np.full(150, 2))
    assert len(calls) == 1 + 18
    with pytest.raises(ValueError, match="at least"):
        pairwise_sensitivity(grad, np.full(150, 2), num_probes=5)


def test_non_finite_gradients_are_capped() -> None:
    def grad(cfg: ProbeConfig) -> np.ndarray:
        return np.full(3, np.inf if cfg.seeds[0] % 2 else 0.0)

    est = probe_sensitivity(grad, [2, 2])
    assert np.all((est == SENSITIVITY_CAP) | (est == 0.0))
    assert np.all(np.isfinite(pairwise_sensitivity(grad, [2, 2, 2])))


def test_rejects_full_precision_probe_widths() -> None:
    with pytest.raises(ValueError, match="quantised"):
        probe_sensitivity(lambda cfg: np.zeros(2), [2, 32])


def test_pairwise_standard_errors_cover_the_error() -> None:
    """On random synthetic models, the true sensitivity lies within 3 reported standard errors
    of the estimate for at least 90% of items (the plug-in is conservative; a standard error of
    zero or one far too small would fail this), and the errors are not vacuously huge."""
    inside, total, relative = 0, 0, []
    for seed in range(6):
        model = LinearNoiseModel.random(n_items=30, dim=2000, seed=seed)
        est = pairwise_sensitivity(model, np.full(30, 3), seed=seed, stderr=True)
        assert isinstance(est, SensitivityEstimate)
        assert np.array_equal(est.value, pairwise_sensitivity(model, np.full(30, 3), seed=seed))
        error = np.abs(est.value - model.sensitivity)
        inside += int(np.sum(error <= 3 * est.stderr))
        total += error.size
        relative.append(np.median(est.stderr / model.sensitivity.mean()))
    assert inside >= 0.9 * total
    assert float(np.median(relative)) < 1.0


def test_floored_estimates_rarely_underestimate() -> None:
    """NOTE [Floored estimates]: at the minimum probe count a raw pairwise estimate often falls
    below a tenth of the true sensitivity (clipped negatives, noise), which would send an item
    to the fewest bits; floored at its standard error it almost never does. Measured over these
    20 models: 104 of 600 raw estimates (17%), no floored one; the bounds (5%, 1%) leave wide
    margins for other BLAS or numpy versions."""
    raw = floored = total = 0
    for seed in range(20):
        model = LinearNoiseModel.random(n_items=30, dim=2000, seed=seed)
        est = pairwise_sensitivity(model, np.full(30, 3), seed=seed, stderr=True)
        low = model.sensitivity / 10
        assert np.array_equal(est.floored(), np.maximum(est.value, est.stderr))
        raw += int(np.sum(est.value < low))
        floored += int(np.sum(est.floored() < low))
        total += low.size
    assert raw >= 0.05 * total
    assert floored <= 0.01 * total


@pytest.mark.parametrize("stderr", [False, True])
def test_pairwise_holds_the_probe_differences_once(stderr: bool) -> None:
    """Memory is one K x D float32 matrix of differences (plus a few float64 gradients in
    flight), not the list of float64 differences, its stacked copy and its square (3 K x D
    float64: 42 MiB for K = 7 at the runtime's sketch width of 2^18 entries, the whole peak an
    adaptation added)."""
    dim, items = 1 << 16, 20
    k = min_pair_probes(items)

    def grad(cfg: ProbeConfig) -> np.ndarray:
        return sum(np.random.default_rng(int(s)).normal(size=dim) for s in cfg.seeds[:2])

    pairwise_sensitivity(grad, [2] * items, stderr=stderr)  # one-time allocations (numpy, BLAS)
    tracemalloc.start()
    try:
        pairwise_sensitivity(grad, [2] * items, stderr=stderr)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    row = dim * 8  # one float64 gradient
    assert peak <= (k / 2 + 6) * row, (peak / row, k)
