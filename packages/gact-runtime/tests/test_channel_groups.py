"""Channel groups keep BatchNorm gradients of small-scale channels, row groups LayerNorm's of
small-scale rows (GactConfig.channel_groups).

The failure they fix (BENCHMARKS.md, "Stability"): a 1x1 feature map, as in the last stage of a
ResNet on 32x32 images, laid out NCHW, puts every channel of a sample in one group of 256; a
channel whose scale is small next to its group's range keeps almost no precision, and
BatchNorm's backward divides that error by the channel's standard deviation. LayerNorm does the
same per row (a token), and groups of 256 span four rows of width 64 (NOTE [Attention and row
normalisations] in decision_rules.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import gact_kernels
import pytest
import torch
from gact import Controller, GactConfig
from gact.ledger import Kind
from torch import nn

CHANNELS = 64


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    conv = nn.Conv2d(32, CHANNELS, 1, bias=False)
    with torch.no_grad():  # output channels of scales 1e-3 .. 1, as trained convs drift to
        conv.weight.mul_(torch.logspace(-3, 0, CHANNELS).view(-1, 1, 1, 1))
    return nn.Sequential(conv, nn.BatchNorm2d(CHANNELS), nn.ReLU())


def _norm_weight_grads(
    model: nn.Module,
    norm: nn.Module,
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
    config: GactConfig | None,
    seeds: range,
) -> torch.Tensor:
    """``norm``'s weight gradients, one row per rounding seed (one row for fp32), for an input
    and a loss projection (a loss that depends on the input) of ``shapes``."""
    gen = torch.Generator().manual_seed(1)
    x, project = (torch.randn(*shape, generator=gen) for shape in shapes)
    return _weight_grads(model, norm, x, project, config, seeds)


def _weight_grads(
    model: nn.Module,
    layer: nn.Module,
    x: torch.Tensor,
    project: torch.Tensor,
    config: GactConfig | None,
    seeds: range,
) -> torch.Tensor:
    """``layer``'s weight gradients of the loss ``(model(x) * project).sum()``, one row per
    rounding seed (one row for fp32)."""
    rows = []
    for seed in seeds:
        model.zero_grad()
        if config is None:
            (model(x) * project).sum().backward()
        else:
            with Controller(model, config.replace(seed=seed)):
                (model(x) * project).sum().backward()
        rows.append(layer.weight.grad.clone())
    return torch.stack(rows)


def _bn_weight_grads(config: GactConfig | None, seeds: range) -> torch.Tensor:
    model = _model()
    shapes = ((64, 32, 1, 1), (64, CHANNELS, 1, 1))
    return _norm_weight_grads(model, model[1], shapes, config, seeds)


@pytest.mark.parametrize("level", ["L1", "L1.2"])
def test_batchnorm_gradient_of_small_channels(level: str) -> None:
    """Worst channel's gradient error (RMS over 8 rounding seeds), relative to the RMS of the
    exact gradient over channels (each channel's is O(sqrt(batch)) whatever its scale).
    The BatchNorm input (64 elements per channel) is stored 4 bits above the level's width
    (NOTE [Small maps] in norm_rules.py). Measured: memory-order groups 1.37 (L1) and 5.8
    (L1.2); channel groups 0.017 and 0.077. The bounds leave 2x room above the latter."""
    exact = _bn_weight_grads(None, range(1))[0]
    cfg = GactConfig.from_level(level)  # BatchNorm statistics (64 elements) kept
    rms = float(exact.pow(2).mean().sqrt())
    bound = 0.035 if level == "L1" else 0.15

    def worst(config: GactConfig) -> float:
        err = (_bn_weight_grads(config, range(8)) - exact).pow(2).mean(0).sqrt()
        return float(err.max()) / rms

    assert worst(cfg.replace(channel_groups=False)) > 5 * bound
    assert worst(cfg) < bound


@pytest.mark.parametrize(("level", "small", "large"), [("L1", 6, 4), ("L1.2", 4, 2)])
def test_saves_of_small_maps_take_two_more_bits(level: str, small: int, large: int) -> None:
    """NOTE [Small maps] in norm_rules.py: a save of rank 4 whose channels hold at most
    ``SMALL_MAP`` elements per step (here 64 x 2 x 2 = 256) is stored 2 bits above the level's
    width whatever reads it (the input, a ReLU's output read by a convolution); the same model
    on 16x16 maps (16,384 per channel) is not."""
    widths = {}
    for size in (2, 16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1))
        with Controller(model, GactConfig.from_level(level, min_numel=0)) as controller:
            model(torch.randn(64, 8, size, size)).square().mean().backward()
            controller.step()
        quantized = [r for r in controller.ledger.last.values() if r.kind is Kind.QUANTIZED]
        assert len(quantized) == 2  # the input, and the ReLU's output (saved once, shared)
        widths[size] = {(r.bits, r.preferred_bits) for r in quantized}
    assert widths == {2: {(small, small)}, 16: {(large, 0)}}


def _heavy_bn_weight_grads(config: GactConfig | None, seeds: range) -> torch.Tensor:
    """A BatchNorm's weight gradients (one row per rounding seed) on 1x1 maps at batch 64 whose
    channels are heavy-tailed (a few samples set each channel's range), as the inputs of a
    trained ResNet's last stages are (BENCHMARKS.md, "Stability")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(CHANNELS))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, CHANNELS, 1, 1, generator=gen)
    x = x.mul(torch.rand(64, CHANNELS, 1, 1, generator=gen).pow(-1.0))
    project = torch.randn(64, CHANNELS, 1, 1, generator=gen)
    return _weight_grads(model, model[0], x, project, config, seeds)


@pytest.mark.parametrize(("level", "bound", "width"), [("L1", 0.05, 8), ("L1.2", 0.2, 6)])
def test_batchnorm_input_on_small_maps_takes_four_more_bits(
    level: str, bound: float, width: int
) -> None:
    """NOTE [Small maps] in norm_rules.py: a BatchNorm's input on small maps is stored 4 bits
    above the level's width. Worst channel's gradient error (RMS over 16 rounding seeds) over
    the RMS of the exact gradient. Measured with 2, 3 and 4 more bits: 0.096, 0.055, 0.023 at
    L1; 0.41, 0.21, 0.096 at L1.2. The bounds leave 2x room above the last."""
    exact = _heavy_bn_weight_grads(None, range(1))[0]
    config = GactConfig.from_level(level)  # its statistics (64 elements each) kept
    err = (_heavy_bn_weight_grads(config, range(16)) - exact).pow(2).mean(0).sqrt()
    assert float(err.max()) / float(exact.pow(2).mean().sqrt()) < bound
    model = nn.Sequential(nn.BatchNorm2d(CHANNELS))
    with Controller(model, config) as controller:
        model(torch.randn(64, CHANNELS, 1, 1)).sum().backward()
        controller.step()
    quantized = [r for r in controller.ledger.last.values() if r.kind is Kind.QUANTIZED]
    assert [(r.bits, r.preferred_bits) for r in quantized] == [(width, width)]


def _sparse_conv_weight_grads(config: GactConfig | None, seeds: range) -> torch.Tensor:
    """A 1x1 convolution's weight gradients (one row per rounding seed) on a ReLU's output of
    1x1 maps at batch 64 whose channels are sparse and heavy-tailed, as a trained ResNet's last
    stage is (BENCHMARKS.md, "Stability")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.Conv2d(CHANNELS, 32, 1, bias=False))
    gen = torch.Generator().manual_seed(1)
    x = (
        torch.randn(64, CHANNELS, 1, 1, generator=gen)
        .sub(1.0)
        .mul(torch.rand(64, CHANNELS, 1, 1, generator=gen).pow(-0.5))
    )  # about 16% positive, their scale heavy-tailed
    project = torch.randn(64, 32, 1, 1, generator=gen)
    return _weight_grads(model, model[1], x, project, config, seeds)


@pytest.mark.parametrize(("level", "bound"), [("L1", 0.033), ("L1.2", 0.145)])
def test_convolution_gradient_on_a_small_sparse_map(level: str, bound: float) -> None:
    """Relative RMS error of the convolution's weight gradient over 8 rounding seeds. Measured
    with the ReLU output at the level's width: 0.067 (L1, 4 bits) and 0.31 (L1.2, 2 bits); 2
    bits above it (NOTE [Small maps]): 0.016 and 0.067. The bounds leave 2x room either way."""
    exact = _sparse_conv_weight_grads(None, range(1))[0]
    rows = _sparse_conv_weight_grads(GactConfig.from_level(level, min_numel=0), range(8))
    assert float((rows - exact).pow(2).mean(0).sum().sqrt() / exact.norm()) < bound


@contextlib.contextmanager
def _channel_dims() -> Iterator[list[int | None]]:
    """The ``channel_dim`` of every ``gact_kernels.quantize_async`` call made in the block."""
    calls: list[int | None] = []
    quantize = gact_kernels.quantize_async

    def spy(*args: object, **kwargs: object) -> gact_kernels.PendingQuantize:
        pending = quantize(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(pending.provisional.channel_dim)
        return pending

    gact_kernels.quantize_async = spy  # type: ignore[assignment]
    try:
        yield calls
    finally:
        gact_kernels.quantize_async = quantize  # type: ignore[assignment]


def test_channel_groups_reach_the_kernels() -> None:
    """Rank-4 saves are quantized with channel_dim=1; rank-2 saves in memory order (the
    tanh's output; the linear layer's input is a view of the ReLU's, stored with it)."""
    model = nn.Sequential(_model(), nn.Flatten(), nn.Linear(CHANNELS, 10), nn.Tanh())
    x = torch.randn(50, 32, 1, 1)  # batch 50: runs of 50 elements, padded to 56
    with _channel_dims() as calls:
        with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
            model(x).sum().backward()
    assert 1 in calls and None in calls
    site = max(
        (r for r in controller.ledger.view()[0].values() if r.metadata_bits is not None),
        key=lambda r: r.metadata_bits,
    )
    # one 8-byte group header per 50 elements and 6 padded elements counted at 8 bits
    assert site.metadata_bits == pytest.approx((64 + 48) / 50)


def _feature_weight_grads(config: GactConfig | None, seeds: range) -> torch.Tensor:
    """A linear layer's weight gradients (one row per rounding seed) on 8 x 64 tokens of width
    64 whose features have scales 1e-3 .. 1, as the learned gains of a norm before it give."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, 64, generator=gen) * torch.logspace(-3, 0, 64)
    project = torch.randn(8, 64, 16, generator=gen)
    return _weight_grads(model, model[0], x, project, config, seeds)


def test_linear_gradient_of_small_scale_features() -> None:
    """NOTE [Feature groups] in storing.py: the weight gradient's column of each input feature,
    its error's RMS over 8 rounding seeds relative to the column's own RMS, worst feature, at
    L1.2. Groups of 256 in memory order span four tokens' 64 features, so a feature of scale
    1e-3 is rounded with the step of one of scale 1: measured 208; grouped by feature, 1.20
    (medians over features 5.2 and 0.78). The bound leaves 2x room."""
    exact = _feature_weight_grads(None, range(1))[0]
    config, bound = GactConfig.from_level("L1.2"), 2.4

    def worst(config: GactConfig) -> float:
        err = (_feature_weight_grads(config, range(8)) - exact).pow(2).mean(0)
        return float((err.mean(0) / exact.pow(2).mean(0)).sqrt().max())

    assert worst(config.replace(channel_groups=False)) > 10 * bound
    assert worst(config) < bound


@pytest.mark.parametrize(
    ("level", "shape", "expected"),
    [
        ("L1.2", (256, 64), [1, 1]),
        ("L1.2", (4, 64, 64), [1, 2]),
        ("L1.2", (100, 64), [None, None]),
        ("L1", (256, 64), [None, None]),
    ],
)
def test_feature_groups_reach_the_kernels(
    level: str, shape: tuple[int, ...], expected: list[int | None]
) -> None:
    """Saves of rank 2 or 3, the input of a linear layer (saved as its 2-D view) and a tanh's
    output, are quantized along their last dimension at levels of at most 3 bits when each
    feature holds at least half a group of rows (here 128), else in memory order (NOTE [Feature
    groups])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh())
    with _channel_dims() as calls:
        with Controller(model, GactConfig.from_level(level, min_numel=0)):
            model(torch.randn(*shape)).sum().backward()
    assert calls == expected


class TokenNorm(nn.Module):
    """A projection to width 64 then LayerNorm (or ``norm``), on tokens whose first (a class
    token) has a scale 100x below the others'."""

    def __init__(self, norm: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(32, 64, bias=False)
        self.norm = norm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(x.shape[1], 1)
        scale[0] = 1e-2
        return self.norm(self.proj(x) * scale)


def _ln_weight_grads(config: GactConfig | None, seeds: range) -> torch.Tensor:
    model = TokenNorm()
    return _norm_weight_grads(model, model.norm, ((64, 16, 32), (64, 16, 64)), config, seeds)


@pytest.mark.parametrize("level", ["L1", "L1.2"])
def test_layernorm_gradient_of_small_rows(level: str) -> None:
    """Relative RMS error of LayerNorm's weight gradient over 8 rounding seeds. Measured:
    memory-order groups 3.3 (L1) and 18.7 (L1.2); row groups 0.12 and 0.59. The bounds leave
    2x room either way."""
    exact = _ln_weight_grads(None, range(1))[0]
    cfg = GactConfig.from_level(level)

    def error(config: GactConfig) -> float:
        rows = _ln_weight_grads(config, range(8))
        return float((rows - exact).pow(2).mean(0).sum().sqrt() / exact.norm())

    bound = 0.25 if level == "L1" else 1.2
    assert error(cfg.replace(channel_groups=False)) > 5 * bound
    assert error(cfg) < bound


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_row_groups_reach_the_kernels(norm: type[nn.Module]) -> None:
    """A LayerNorm's or RMSNorm's input is quantized one row per group (a 2-D view,
    channel_dim=0) and given back in its shape; its per-row statistics are kept as they are."""
    model = TokenNorm(norm)
    x = torch.randn(64, 16, 32)
    with Controller(model, GactConfig.from_level("L1")) as controller:
        model(x).sum().backward()
        controller.step()
    records = {r.key: r for r in controller.ledger.last.values()}
    norm_input = [r for k, r in records.items() if k.startswith("norm") and r.shape == (64, 16, 64)]
    # the input (RMSNorm's composite also saves the normalised rows: equal scales, memory order)
    assert (Kind.QUANTIZED, 1.0) in [(r.kind, r.metadata_bits) for r in norm_input]
    stats = [r for k, r in records.items() if k.startswith("norm") and r.shape == (64, 16, 1)]
    assert stats and all(r.kind is Kind.KEPT for r in stats)


@pytest.mark.parametrize("channels", [1024, 2048])
@pytest.mark.parametrize("level", ["L1", "L2.2"])
def test_batchnorm_statistics_are_kept_however_many_channels(channels: int, level: str) -> None:
    """BatchNorm's saved per-channel mean and reciprocal spread are kept as they are, as
    LayerNorm's per-row ones are, also when there are ``min_numel`` channels or more (ResNet-50's
    1024 and 2048): its backward normalises every element with them, and rounding them made the
    weight gradient of the layer before biased (about 12% over 40 seeds at 4 bits)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, channels), nn.BatchNorm1d(channels), nn.ReLU())
    with Controller(model, GactConfig.from_level(level)) as controller:
        model(torch.randn(64, 16)).sum().backward()
        controller.step()
    records = [r for r in controller.ledger.last.values() if r.kind is not Kind.PARAMETER]
    stats = [r for r in records if r.shape == (channels,)]
    assert len(stats) == 2 and all(r.kind is Kind.KEPT for r in stats), stats
    inputs = [r for r in records if r.shape == (64, channels)]
    assert Kind.QUANTIZED in [r.kind for r in inputs]  # the input itself is still compressed


@pytest.mark.parametrize("level", ["L1", "L2.2"])
def test_rmsnorm_input_is_stored_once(level: str) -> None:
    """RMSNorm's composite saves its input twice in one call (``pow`` and ``mul``), as autograd
    holds one tensor: stored once, with the row groups that call asks for, and counted once
    (it was quantized and counted twice: a ratio of 6.8x reported for a true 5.2x)."""
    model = TokenNorm(nn.RMSNorm)
    x = torch.randn(64, 16, 32)
    original = {}
    for lvl in ("L0", level):
        with Controller(model, GactConfig.from_level(lvl, min_numel=0)) as controller:
            model(x).sum().backward()
            controller.step()
        original[lvl] = controller.stats()["original_bytes"]
    assert original[level] == original["L0"]
    rows = [r for r in controller.ledger.last.values() if r.shape == (64, 16, 64)]
    inputs = [r for r in rows if r.key.startswith("norm") and r.metadata_bits == 1.0]
    assert len(inputs) == 1 and inputs[0].kind is Kind.QUANTIZED and inputs[0].count == 1


class _FeaturesThenBatchNorm(nn.Module):
    """Features of scales 1e-2 .. 1e2, then BatchNorm1d, ReLU and a projection: a linear layer
    on rows (``rank`` 2), or a 1x1 convolution on sequences (3: batch, channel, position)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.Linear if rank == 2 else functools.partial(nn.Conv1d, kernel_size=1)
        self.a, self.bn, self.out = layer(16, 64), nn.BatchNorm1d(64), layer(64, 4)
        scales = torch.logspace(-2, 2, 64)[torch.randperm(64)]
        with torch.no_grad():
            self.a.weight.mul_(scales.view(-1, *[1] * (self.a.weight.dim() - 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.a(x))))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("rank", [2, 3])
def test_batchnorm1d_input_is_grouped_by_channel(rank: int, compiled: bool) -> None:
    """A BatchNorm1d input of rank 2 or 3 is grouped by channel, as rank 4 ones are: in memory
    order a group spans channels whose scales differ 1e4x, the small one keeps almost no level,
    and BatchNorm's backward divides that error by its spread. Relative RMS error of the first
    layer's weight gradient over 4 seeds at L1: 17-23 in memory order (eager and compiled, both
    ranks), 0.16-0.17 with channel groups; the bound leaves 2x room."""
    model = _FeaturesThenBatchNorm(rank)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*((256, 16) if rank == 2 else (16, 16, 16)), generator=gen)
    project = torch.randn(*((256, 4) if rank == 2 else (16, 4, 16)), generator=gen)
    exact = _weight_grads(model, model.a, x, project, None, range(1))[0]
    if compiled:
        torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    with _channel_dims() as calls:
        rows = _weight_grads(run, model.a, x, project, GactConfig.from_level("L1"), range(4))
    assert 1 in calls
    error = (rows - exact).pow(2).mean(0).sum().sqrt() / exact.norm()
    assert error < 0.3, float(error)
