"""Bad input gets a clear exception naming the argument, or a correct result (never garbage)."""

import warnings

import numpy as np
import pytest
from gact_policy import (
    InfeasibleBudgetError,
    ProbeConfig,
    SensitivityTracker,
    allocate,
    allocate_bits,
    min_pair_probes,
    min_storage_bits,
    pairwise_sensitivity,
    predicted_variance,
    probe_sensitivity,
    smooth,
    storage_bits,
    variance_factor,
)

ONE = [1.0, 1.0]
SIZES = [10, 10]


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_infinite_and_huge_sensitivities_are_the_most_sensitive() -> None:
    bits = allocate_bits([1e308, np.inf], [1000] * 2, 4.0)  # used to overflow: inf got 1 bit
    assert bits[1] >= bits[0] and bits[1] > 1
    assert allocate_bits([1.0, 1e308], [1000] * 2, 4.0).tolist() == [1, 7]
    # NaN: twice the largest finite value; the tiny ones keep their ratio (no underflow to 0).
    assert allocate_bits([np.nan, 1e-300, 5e-324], [1000] * 3, 4.0).tolist() == [6, 5, 1]


def test_costs_that_could_overflow_int64_are_refused() -> None:
    # Σ numel·32 = 2**65 bits: the int64 cost arithmetic used to wrap and return widths over
    # the budget.
    with pytest.raises(ValueError, match="numel"):
        allocate_bits(ONE, [2**59] * 2, 20.0)
    with pytest.raises(ValueError, match="numel"):
        storage_bits([2**59] * 2, [32, 32])
    with pytest.raises(ValueError, match="overhead_bits"):
        allocate_bits(ONE, SIZES, 4.0, overhead_bits=1e300)
    big = [2**54, 2**54 + 1]  # still exact: 2**60 bits at most
    bits = allocate_bits(ONE, big, 5.0, overhead_bits=0.25)
    assert storage_bits(big, bits, overhead_bits=0.25) <= 5 * sum(big)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"budget_bytes": float("inf")}, ValueError, "budget_bytes"),
        ({"budget_bytes": float("nan")}, ValueError, "budget_bytes"),
        ({"budget_bytes": 2.5}, ValueError, "budget_bytes"),
        ({"budget_bytes": -8}, ValueError, "budget_bytes"),
        ({"budget_bytes": True}, TypeError, "budget_bytes"),
        ({"budget_bytes": "8"}, TypeError, "budget_bytes"),
    ],
)
def test_bad_budget_bytes(kwargs, error, name) -> None:
    with pytest.raises(error, match=name):
        allocate_bits(ONE, SIZES, None, **kwargs)


@pytest.mark.parametrize(
    ("avg_bits", "error"),
    [("4", TypeError), (True, TypeError), (np.bool_(True), TypeError), ([4.0], TypeError),
     (float("nan"), ValueError), (float("inf"), ValueError), (-1.0, ValueError)],
)  # fmt: skip
def test_bad_avg_bits(avg_bits, error) -> None:
    with pytest.raises(error, match="avg_bits"):
        allocate_bits(ONE, SIZES, avg_bits)


def test_budget_arguments() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        allocate_bits(ONE, SIZES, None)
    assert allocate_bits(ONE, SIZES, 4.0).tolist() == [4, 4]
    assert allocate_bits(ONE, SIZES, np.float32(4.0)).tolist() == [4, 4]
    assert allocate_bits(ONE, SIZES, 4).tolist() == [4, 4]
    assert allocate_bits(ONE, SIZES, None, budget_bytes=np.int64(10)).tolist() == [4, 4]
    assert allocate_bits(ONE, SIZES, None, budget_bytes=10.0).tolist() == [4, 4]
    # Budgets beyond any cost buy full precision, however large.
    assert allocate_bits(ONE, SIZES, None, budget_bytes=10**30).tolist() == [32, 32]
    assert allocate_bits(ONE, SIZES, 1e300).tolist() == [32, 32]


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"choices": [2.5, 4]}, ValueError, "choices"),
        ({"choices": [True, 4]}, TypeError, "choices"),
        ({"choices": "48"}, TypeError, "choices"),
        ({"choices": [[2, 4]]}, ValueError, "choices"),
        ({"choices": []}, ValueError, "choices"),
        ({"choices": [0, 4]}, ValueError, "choices"),
        ({"pinned": [True, 0]}, TypeError, "pinned"),
        ({"pinned": [2.5, 0]}, ValueError, "pinned"),
        ({"pinned": [-1, 0]}, ValueError, "pinned"),
        ({"lower": 2.5}, ValueError, "lower"),
        ({"upper": [4, 4, 4]}, ValueError, "upper"),
        ({"full_bits": True}, TypeError, "full_bits"),
        ({"full_bits": 8}, ValueError, "full_bits"),
        ({"overhead_bits": np.nan}, ValueError, "overhead_bits"),
        ({"overhead_bits": -0.5}, ValueError, "overhead_bits"),
        ({"overhead_bits": [0.25, 0.25, 0.25]}, ValueError, "overhead_bits"),
        ({"overhead_bits": [True, False]}, TypeError, "overhead_bits"),
        ({"method": None}, ValueError, "method"),
        ({"max_states": -1}, ValueError, "max_states"),
        ({"max_states": "fast"}, ValueError, "max_states"),
        ({"max_states": True}, TypeError, "max_states"),
        ({"max_states": 2.5}, ValueError, "max_states"),
    ],
)
def test_bad_keyword_arguments(kwargs, error, name) -> None:
    with pytest.raises(error, match=name):
        allocate_bits(ONE, SIZES, 4.0, **kwargs)


@pytest.mark.parametrize(
    ("sensitivity", "numel", "error", "name"),
    [
        ([[1.0, 1.0], [1.0, 1.0]], [10] * 4, ValueError, "sensitivity"),
        (1.0, 10, ValueError, "sensitivity"),
        ([1.0, -1.0], SIZES, ValueError, "sensitivity"),
        ([1.0, -np.inf], SIZES, ValueError, "sensitivity"),
        (["a", "b"], SIZES, TypeError, "sensitivity"),
        ([1j, 1.0], SIZES, TypeError, "sensitivity"),
        (np.array([1.0, None], dtype=object), SIZES, TypeError, "sensitivity"),
        ([True, False], SIZES, TypeError, "sensitivity"),
        (ONE, [np.nan, 10], ValueError, "numel"),
        (ONE, [10.5, 10], ValueError, "numel"),
        (ONE, [True, 10], TypeError, "numel"),
        (ONE, [-5, 10], ValueError, "numel"),
        (ONE, [2**70, 10], TypeError, "numel"),
        (ONE, np.array([2**63, 10], dtype=np.uint64), ValueError, "numel"),
        (ONE, [10, 10, 10], ValueError, "numel"),
        (ONE, [[10, 10]], ValueError, "numel"),
    ],
)
def test_bad_items(sensitivity, numel, error, name) -> None:
    with pytest.raises(error, match=name):
        allocate_bits(sensitivity, numel, 4.0)


def test_whole_floats_are_accepted_where_integers_are_expected() -> None:
    bits = allocate_bits(ONE, [10.0, 10.0], 4.0, choices=[2.0, 4.0], full_bits=32.0)
    assert bits.tolist() == [4, 4] and bits.dtype == np.int64


def test_empty_inputs() -> None:
    assert allocate_bits([], [], 4.0).tolist() == []
    assert allocate_bits([], [], None, budget_bytes=0).tolist() == []
    a = allocate([], [], 4.0)
    assert (a.storage_bits, a.variance, a.optimal) == (0, 0.0, True)
    assert storage_bits([], []) == 0
    assert min_storage_bits([]) == 0
    assert predicted_variance([], []) == 0.0
    assert smooth(None, [], 0.5).tolist() == []
    with pytest.raises(ValueError, match="avg_bits"):
        allocate_bits([], [], float("nan"))


def test_infeasible_budget_states_the_minimum() -> None:
    n, ov = [1000, 3000], [0.25, 2.0]
    least = min_storage_bits(n, overhead_bits=ov)
    assert least == 1000 * 1.25 + 3000 * 3
    with pytest.raises(InfeasibleBudgetError, match="minimum achievable average") as info:
        allocate_bits(ONE, n, None, budget_bytes=least // 8 - 1, overhead_bits=ov)
    assert isinstance(info.value, ValueError)
    assert info.value.min_bits == least
    # The fallback a caller can take: the smallest allocation.
    bits = allocate_bits(ONE, n, None, budget_bytes=-(-least // 8), overhead_bits=ov)
    assert bits.tolist() == [1, 1]


def test_predicted_variance_checks_lengths_and_types() -> None:
    with pytest.raises(ValueError, match="bits"):
        predicted_variance([1.0, 2.0, 3.0], [2, 2])
    with pytest.raises(ValueError, match="sensitivity"):
        predicted_variance([[1.0, 2.0]], [[2, 2]])
    with pytest.raises(TypeError, match="bits"):
        predicted_variance([1.0], [True])
    with pytest.raises(ValueError, match="bits"):
        predicted_variance([1.0], [np.nan])
    assert predicted_variance([1.0, 9.0], 2) == pytest.approx(10 / 9)


def test_storage_bits_checks() -> None:
    with pytest.raises(ValueError, match="numel"):
        storage_bits([-5, 10], [2, 2])  # used to return 10
    with pytest.raises(ValueError, match="bits"):
        storage_bits([5, 10], [0, 2])
    with pytest.raises(ValueError, match="bits"):
        storage_bits([5, 10], [2, 2, 2])
    assert storage_bits([5, 10], 4) == 60


def test_variance_factor_types() -> None:
    with pytest.raises(TypeError, match="bits"):
        variance_factor(True)
    with pytest.raises(ValueError, match="bits"):
        variance_factor(np.nan)
    with pytest.raises(TypeError, match="bits"):
        variance_factor("4")
    assert variance_factor(np.array([[1, 2]])).shape == (1, 2)


def test_smooth_is_finite_and_checked() -> None:
    # Both sides non-finite somewhere: the docstring promises a finite result.
    assert smooth([1.0, np.nan], [np.nan, 2.0], 0.5).tolist() == [1.0, 2.0]
    assert smooth([np.inf, 4.0], [2.0, 2.0], 0.5).tolist() == [2.0, 3.0]
    with pytest.raises(TypeError, match="momentum"):
        smooth([1.0], [1.0], True)
    with pytest.raises(TypeError, match="momentum"):
        smooth([1.0], [1.0], "0.5")
    with pytest.raises(ValueError, match="momentum"):
        smooth([1.0], [1.0], np.nan)
    with pytest.raises(ValueError, match="prev"):
        smooth([-1.0], [1.0], 0.5)
    with pytest.raises(ValueError, match="new"):
        smooth(None, [[1.0, 2.0]], 0.5)
    with pytest.raises(TypeError, match="new"):
        smooth(None, np.array([1.0, None], dtype=object), 0.5)


def test_tracker_state_survives_bad_input() -> None:
    t = SensitivityTracker(momentum=0.5)
    t.update([2.0, 4.0])
    with pytest.raises(ValueError):
        t.update([1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        t.update([1.0, -2.0])
    assert t.value.tolist() == [2.0, 4.0]


def _zero_grad(cfg: ProbeConfig) -> np.ndarray:
    return np.zeros(3)


def test_estimator_arguments() -> None:
    with pytest.raises(TypeError, match="n_items"):
        min_pair_probes(True)
    with pytest.raises(ValueError, match="n_items"):
        min_pair_probes(2.5)
    with pytest.raises(ValueError, match="n_items"):
        min_pair_probes(-1)
    with pytest.raises(ValueError, match="num_probes"):
        pairwise_sensitivity(_zero_grad, [2, 2, 2], num_probes=3.5)
    with pytest.raises(ValueError, match="cap"):
        probe_sensitivity(_zero_grad, [2, 2], cap=np.nan)
    with pytest.raises(ValueError, match="cap"):
        pairwise_sensitivity(_zero_grad, [2, 2], cap=-1.0)
    with pytest.raises(ValueError, match="high_bits"):
        probe_sensitivity(_zero_grad, [2, 2], robust=True, high_bits=0)
    with pytest.raises(ValueError, match="seed"):
        probe_sensitivity(_zero_grad, [2, 2], seed=-1)
    with pytest.raises(TypeError, match="bits"):
        probe_sensitivity(_zero_grad, [True, True])
    with pytest.raises(TypeError, match="bits"):
        ProbeConfig(np.array([True]), np.array([1], dtype=np.uint64))


def test_gradients_of_changing_length_are_refused() -> None:
    # Differences of gradients of different lengths used to broadcast silently.
    def grad(cfg: ProbeConfig) -> np.ndarray:
        return np.zeros(1 + int(cfg.seeds[0] % 5))

    with pytest.raises(ValueError, match="length"):
        probe_sensitivity(grad, [2, 2])
    with pytest.raises(ValueError, match="length"):
        pairwise_sensitivity(grad, [2, 2, 2])
