"""How a new save is stored (storing.py): the rules of feature groups, expanded views and the
metadata the allocator is told about, checked on their own."""

from __future__ import annotations

import gact_kernels
import pytest
import torch
from gact import GactConfig
from gact.storing import FEATURE_GROUP_BITS, _compact, _metadata_bits, _two_valued, feature_dim


@pytest.mark.parametrize("width", [2, FEATURE_GROUP_BITS])
def test_feature_groups_for_stacks_of_feature_vectors_at_low_widths(width: int) -> None:
    config = GactConfig()  # group size 256
    assert feature_dim(torch.randn(128, 64), config, width) == 1
    assert feature_dim(torch.randn(4, 32, 64), config, width) == 2
    # not above FEATURE_GROUP_BITS, nor without channel groups
    assert feature_dim(torch.randn(128, 64), config, FEATURE_GROUP_BITS + 1) is None
    assert feature_dim(torch.randn(128, 64), GactConfig(channel_groups=False), width) is None
    # rank 4 is a channel map's (channel groups), rank 1 has no features
    assert feature_dim(torch.randn(2, 8, 8, 8), config, width) is None
    assert feature_dim(torch.randn(4096), config, width) is None
    # fewer rows than half a group per feature, one feature, or gaps in memory
    assert feature_dim(torch.randn(127, 64), config, width) is None
    assert feature_dim(torch.randn(128, 1), config, width) is None
    assert feature_dim(torch.randn(64, 128).t(), config, width) is None


def test_an_expanded_view_is_stored_by_its_base() -> None:
    base = torch.randn(3, 1, 5)
    expanded = base.expand(3, 4, 5)
    compact = _compact(expanded)
    assert compact is not None and compact.shape == (3, 1, 5)
    assert compact.data_ptr() == base.data_ptr() and torch.equal(compact, base)
    assert _compact(base) is None  # contiguous: nothing repeated
    assert _compact(torch.randn(5, 6).t()) is None  # strided, but no stride-0 repeats
    assert _compact(torch.randn(5, 1).expand(5, 1)) is None  # stride 0 only on a size-1 dim


def test_two_valued_tensors() -> None:
    assert _two_valued(torch.tensor([0.0, 2.0, 2.0, 0.0]))  # a dropout mask's scale
    assert _two_valued(torch.full((7,), 3.0))  # constant
    assert not _two_valued(torch.tensor([0.0, 1.0, 2.0]))
    assert not _two_valued(torch.tensor([0.0, float("nan")]))
    assert not _two_valued(torch.empty(0))


@pytest.mark.parametrize("bits", [2, 4])
def test_metadata_counts_headers_and_channel_padding(bits: int) -> None:
    flat = gact_kernels.quantize(torch.randn(1024), bits, seed=0)
    # 4 groups of 256: one fp32 lo and scale each, 64 bits per group, 0.25 per element
    assert _metadata_bits(flat, flat.nbytes) == pytest.approx(0.25)
    # channels of 100 elements padded to groups of 104 (the kernels' layout): 4 padded elements
    # per channel counted at 8 bits, beside one header per channel
    x = torch.randn(1, 10, 10, 10)
    maps = gact_kernels.quantize(x, bits, group_size=104, seed=0, channel_dim=1)
    assert maps.stored_numel == 10 * 104
    expected = (10 * 64 + 8 * 10 * 4) / x.numel()
    assert _metadata_bits(maps, maps.nbytes) == pytest.approx(expected)


class _IntegerExponents(torch.nn.Module):
    """``x ** e`` with integer exponents, which autograd saves: ``spread`` sets their range."""

    def __init__(self, spread: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("e", torch.randint(-spread, spread, (64, 8), generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = self.lin(x) * 0 + 1  # 1 ** e stays 1 whatever e is
        return torch.pow(ones, self.e + 0).sum()  # a fresh tensor: an activation, not a buffer


@pytest.mark.parametrize("spread", [3, 2**62])
def test_an_integer_save_that_packing_does_not_shrink_is_kept(spread: int) -> None:
    """NOTE [Integer saves] in storing.py: an integer save whose values span their dtype's range
    (an LSTM's uint8 workspace on the CPU, 16 MB a layer) packed to 1.035x its bytes, and its
    restored copy beside the packed one in the backward took the step's peak to 1.06-1.34x
    fp32's. A key whose packing does not shrink its bytes 3 times (``INTEGER_GAIN``) is kept
    as it is from its next save on; one of a small range stays packed. (The test's failure
    before: the second step's random 64-bit values packed again, at 1.03x their bytes.)"""
    from gact import Controller
    from gact.ledger import Kind

    model = _IntegerExponents(spread)
    x = torch.randn(64, 8)
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        kinds = []
        for _ in range(2):
            model(x).backward()
            controller.step()
            records = controller.ledger.last.values()
            (ints,) = [r for r in records if r.dtype is torch.int64]
            kinds.append(ints.kind)
            assert ints.stored_bytes <= 1.04 * ints.original_bytes
    if spread > 3:
        assert kinds == [Kind.PACKED, Kind.KEPT] and ints.stored_bytes == ints.original_bytes
    else:
        assert kinds == [Kind.PACKED, Kind.PACKED] and ints.stored_bytes <= ints.original_bytes / 8
