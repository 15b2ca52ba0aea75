"""What the benchmark runs: the examples, their configurations, metrics and targets.

Everything that differs between examples is data here (:class:`Example`, :class:`Metric`);
the tables and plots read it and hold no per-example branches.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from ..levels import matched_level, split_level

__all__ = [
    "ACCURACY",
    "ADAPTIVE_PAIRS",
    "BASE_LEVELS",
    "EXAMPLES",
    "SCRIPTS",
    "TARGETS",
    "VAL_LOSS",
    "Example",
    "Metric",
    "Plan",
    "command_template",
    "run_args",
]

#: Script of each example family, relative to the ``examples/`` folder.
SCRIPTS = {
    "gnn": "gnn/train_gnn.py",
    "vision": "vision/train_vision.py",
    "text": "text/train_char_gpt.py",
}
#: Each adaptive level and the uniform level of the same bits per element.
ADAPTIVE_PAIRS = (("L2", "L1"), ("L2.2", "L1.2"))
#: Levels of every benchmark (L3 is added on CUDA): each adaptive level also at its uniform
#: level's stored bytes (NOTE [Matched levels]), after that level.
BASE_LEVELS = ("L0", "L1", "L1.2", "L2", "L2.2", *(matched_level(a, u) for a, u in ADAPTIVE_PAIRS))
#: Compression ratios, the peak-memory reduction (fp32 over L2), the adaptation cost (% of
#: training time) and the share of examples on which an adaptive level beats its uniform one
#: at equal bytes by more than one standard error, as the tables check.
TARGETS = {
    "L2_ratio": 7.0,
    "L2.2_ratio": 12.0,
    "peak_reduction": 3.0,
    "adaptation_cost": 5.0,
    "adaptive_wins": 0.5,
}


@dataclass(frozen=True)
class Metric:
    """How an example's final metric is shown and compared with fp32.

    Args:
        key: the record's ``metric`` value (``test_accuracy``, ``val_loss``).
        label: axis and table label, with its unit.
        scale: factor from the record's value to the shown one (100 for a fraction in %).
        digits: decimals shown.
        higher_is_better: accuracy-like (gap in points) or loss-like (gap in % of fp32).
        limit: the largest possible shown value (100 for accuracies), for chart axes.

    Example:
        >>> round(ACCURACY.gap(fp32=97.0, level=96.8), 2), ACCURACY.meets(-0.2, target=0.5)
        (-0.2, True)
        >>> ACCURACY.better(0.6, margin=0.5), VAL_LOSS.better(0.6, margin=0.5)
        (True, False)
        >>> round(VAL_LOSS.gap(fp32=2.0, level=2.02), 2), VAL_LOSS.target_text(2.0)
        (1.0, '≤ +2 %')
    """

    key: str
    label: str
    scale: float
    digits: int
    higher_is_better: bool
    limit: float | None = None

    @property
    def gap_unit(self) -> str:
        return "pt" if self.higher_is_better else "%"

    def gap(self, fp32: float, level: float) -> float:
        """``level`` against ``fp32`` (shown values): a difference in points, or in % of fp32."""
        if self.higher_is_better:
            return level - fp32
        return (level - fp32) / fp32 * 100 if fp32 else math.nan

    def meets(self, gap: float, target: float) -> bool:
        """Whether ``gap`` is within ``target`` (no worse than fp32 by more than it)."""
        return gap >= -target if self.higher_is_better else gap <= target

    def better(self, gap: float, margin: float) -> bool:
        """Whether ``gap`` is better than fp32 (or another reference) by more than ``margin``."""
        return gap > margin if self.higher_is_better else gap < -margin

    def target_text(self, target: float) -> str:
        return f"≥ −{target:g} pt" if self.higher_is_better else f"≤ +{target:g} %"


ACCURACY = Metric("test_accuracy", "test accuracy (%)", 100.0, 2, True, limit=100.0)
VAL_LOSS = Metric("val_loss", "validation loss (nats/char)", 1.0, 3, False)


@dataclass(frozen=True)
class Example:
    """One benchmarked example.

    Args:
        name: short key (``--examples`` takes these).
        script: key of :data:`SCRIPTS`.
        title: row and panel title.
        train: options of the training runs (full size).
        quick: options of the training runs with ``--quick``.
        mem: options of the activation-dominated memory run (``--get-mem``); None for none.
        mem_title: the memory run's configuration in a few words, for chart titles.
        metric: how its final metric is compared.
        target: allowed L2 gap to fp32 (points, or % of the loss).
        checked: whether the target counts in the checklist (False: shown for reference only).
        max_batch: search the largest batch that fits on a GPU.
    """

    name: str
    script: str
    title: str
    train: tuple[str, ...]
    quick: tuple[str, ...]
    mem: tuple[str, ...] | None = None
    mem_title: str = ""
    metric: Metric = ACCURACY
    target: float = 0.5
    checked: bool = True
    max_batch: bool = False


def _a(options: str) -> tuple[str, ...]:
    return tuple(options.split())


# Sized so that all six examples x 5 levels x 3 seeds finish within an hour on 2 shared CPU cores.
EXAMPLES = (
    Example(
        "gcn", "gnn", "GCN / Cora", _a("--model gcn --epochs 100"), _a("--model gcn --epochs 50")
    ),
    Example(
        "sage",
        "gnn",
        "GraphSAGE / Cora",
        _a("--model sage --epochs 100"),
        _a("--model sage --epochs 50"),
    ),
    Example(
        "gat", "gnn", "GAT / Cora", _a("--model gat --epochs 100"), _a("--model gat --epochs 50")
    ),
    Example(
        "mnist",
        "vision",
        "ResNet-small / MNIST",
        _a("--dataset mnist --epochs 1 --train-subset 15000"),
        _a("--dataset mnist --epochs 1 --train-subset 2000 --test-subset 2000"),
        mem=_a("--dataset mnist --blocks 3 --batch-size 512 --mem-steps 3"),
        mem_title="3 blocks per stage, batch 512",
        target=0.3,
        max_batch=True,
    ),
    Example(
        "cifar10",
        "vision",
        "ResNet-small / CIFAR-10 (JPEG)",
        _a("--dataset cifar10 --epochs 1 --train-subset 10000 --test-subset 5000"),
        _a("--dataset cifar10 --epochs 1 --train-subset 1000 --test-subset 1000"),
        target=0.5,
    ),
    Example(
        "text",
        "text",
        "char-GPT / tiny-shakespeare",
        _a("--epochs 1 --steps-per-epoch 250"),
        _a("--epochs 1 --steps-per-epoch 40 --eval-batches 5"),
        mem=_a("--n-layer 6 --batch-size 64 --block-size 128 --mem-steps 3"),
        mem_title="6 layers, batch 64 x 128 tokens",
        metric=VAL_LOSS,
        target=2.0,
        max_batch=True,
    ),
)


@dataclass(frozen=True)
class Plan:
    """What one benchmark invocation covers.

    Args:
        examples: the examples, in table order.
        levels: GACT levels (``L0`` is the fp32 baseline).
        seeds: seeds per training configuration (0 .. seeds-1).
        quick: the small ``quick`` configurations instead of ``train``.
        memory: run the memory configurations too.
        data: the folder holding every dataset.
        device: ``--device`` for every run (None: the scripts' default).
    """

    examples: tuple[Example, ...]
    levels: tuple[str, ...]
    seeds: int
    quick: bool = False
    memory: bool = True
    data: str = "DATA"
    device: str | None = None

    @property
    def own_levels(self) -> tuple[str, ...]:
        """The levels run at their own settings, matched ones (``L2@L1``, NOTE [Matched
        levels]) left out: those of the memory runs and the max-batch search."""
        return tuple(lv for lv in self.levels if split_level(lv)[1] is None)


def run_args(
    ex: Example,
    plan: Plan,
    level: str,
    seed: int | str,
    json_path: Path | str,
    kind: str,
    memory_budget: int | str | None = None,
) -> list[str]:
    """Options of one run of ``ex``'s script; ``kind`` is ``"train"`` or ``"mem"``.

    Args:
        memory_budget: a matched level's (``L2@L1``) bytes: its uniform level's stored bytes
            in the same example and seed (NOTE [Matched levels]).

    Raises:
        ValueError: a matched level without ``memory_budget``, or another level with one.

    Example:
        >>> plan = Plan(EXAMPLES[:1], ("L1", "L2@L1"), 1)
        >>> run_args(EXAMPLES[0], plan, "L2", 0, "r.json", "train")[:6]
        ['--data', 'DATA', '--model', 'gcn', '--epochs', '100']
        >>> run_args(EXAMPLES[0], plan, "L2@L1", 0, "r.json", "train", 2**20)[-7:-3]
        ['--level', 'L2', '--memory-budget', '1048576']
    """
    name, uniform = split_level(level)
    if (uniform is None) != (memory_budget is None):
        need = f"the stored bytes of its {uniform} run" if uniform else "none: it runs as it is"
        raise ValueError(f"level {level!r} takes memory_budget={need}, got {memory_budget!r}")
    if kind == "mem":
        base = [*(ex.mem or ()), "--get-mem"]
    else:
        base = list(ex.quick if plan.quick else ex.train)
    options = ["--data", str(plan.data), *base, "--seed", str(seed), "--gact", "--level", name]
    if memory_budget is not None:
        options += ["--memory-budget", str(memory_budget)]
    if plan.device:
        options += ["--device", plan.device]
    return [*options, "--no-progress", "--json", str(json_path)]


def command_template(ex: Example, plan: Plan, kind: str) -> str:
    """The command of ``ex``'s runs as a user types it, with LEVEL, SEED and OUT.json."""
    options = run_args(ex, replace(plan, data="DATA"), "L0", "SEED", "OUT.json", kind)
    options[options.index("--level") + 1] = "LEVEL"
    return shlex.join(["python", f"examples/{SCRIPTS[ex.script]}", *options])
