"""Adaptive precision: sensitivity probes and bit allocation through ``gact_policy``."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import gact_policy
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .errors import GactWarning
from .hooks import SaveHooks
from .ledger import Kind, SiteRecord
from .measured import SensitivityMeter
from .measured_norms import has_batch_norm
from .plan import BitPlan, mix_seed
from .probes import ProbeSession

__all__ = ["Adapter", "Items", "preference_tiers", "rank_zeros"]

logger = logging.getLogger("gact")


@dataclass(frozen=True)
class Items:
    """The tensors an adaptation allocates bits to, and what else the step stores.

    Args:
        keys: save-site keys of the items.
        numel: elements per item (summed over the step's saves at that key).
        full_bits: width of the item's dtype (its cost when kept at full precision).
        overhead_bits: metadata plus exact decision masks per element of a quantized item:
            the metadata its last quantized save held (channel groups of small maps cost more
            than ``metadata_bits``), else ``metadata_bits`` (a derivative table's codes carry a
            9-byte group header, not 8: NOTE [Derivative tables] in pointwise.py).
        lower: the smallest width of each item: 2 on the zero-exact grid (NOTE [Exact
            decisions] in decisions.py), the saving call's ``min_bits`` (6 for fused attention
            whose fused backward reads them: NOTE [Attention and row normalisations]), else 1.
        pinned: 1 for two-valued items (NOTE [Two-valued tensors]), else 0 (free).
        preferred: the width each item takes at least where the budget holds it (``lower``,
            or 2 more on small maps and for recomputed attention's queries and keys: NOTE
            [Small maps] and NOTE [Attention and row normalisations] in decision_rules.py),
            yielding a bit at a time where it does not (NOTE [Preference tiers]).
        fixed_bytes: bytes the step stores outside the items (kept tensors, masks, packs).
        decided_numel, decided_bits: elements of the saves stored as their decisions alone,
            and the bits those hold: an adaptive level's average covers them (NOTE [Decision-only
            saves] in saved.py), as it covers two-valued items pinned at 1 bit.
    """

    keys: list[str]
    numel: np.ndarray
    full_bits: np.ndarray
    overhead_bits: np.ndarray
    lower: np.ndarray
    pinned: np.ndarray
    preferred: np.ndarray
    fixed_bytes: int
    decided_numel: int = 0
    decided_bits: int = 0

    @classmethod
    def of(
        cls, sites: dict[str, SiteRecord], metadata_bits: float, two_valued: dict[str, bool]
    ) -> Items:
        rows = [
            (
                r.key,
                r.numel,
                torch.finfo(r.dtype).bits,
                (metadata_bits if r.metadata_bits is None else r.metadata_bits)
                + r.mask_bits
                + (metadata_bits / 8 if r.table else 0.0),
                max(2 if r.zero_exact else 1, r.min_bits),
                1 if _two_valued(r, two_valued) else 0,
                r.preferred_bits,
            )
            for r in sites.values()
            if _quantizable(r)
        ]
        fixed = sum(
            r.stored_bytes
            for r in sites.values()
            if r.kind is not Kind.PARAMETER and not _quantizable(r)
        )
        decided = [r for r in sites.values() if r.kind is Kind.DECISIONS]
        decided_numel = sum(r.numel for r in decided)
        decided_bits = 8 * sum(r.stored_bytes for r in decided)
        rows, fixed, decided_numel, decided_bits = rank_zeros(
            (rows, fixed, decided_numel, decided_bits)
        )
        lower = np.array([row[4] for row in rows], dtype=np.int64)
        return cls(
            keys=[row[0] for row in rows],
            numel=np.array([row[1] for row in rows], dtype=np.int64),
            full_bits=np.array([row[2] for row in rows], dtype=np.int64),
            overhead_bits=np.array([row[3] for row in rows], dtype=np.float64),
            lower=lower,
            pinned=np.array([row[5] for row in rows], dtype=np.int64),
            preferred=np.maximum(lower, np.array([row[6] for row in rows], dtype=np.int64)),
            fixed_bytes=fixed,
            decided_numel=decided_numel,
            decided_bits=decided_bits,
        )


# NOTE [Two-valued tensors]
# A tensor whose elements all equal its minimum or its maximum (binary features such as Cora's
# bag of words, one-hot inputs, masks stored as floats) is stored exactly at 1 bit: each group's
# two levels are its minimum and maximum. When a key is first seen at an adaptive level, its
# tensor is checked (one pass, only then, probes included), and allocations pin two-valued keys
# at 1 bit: the bits they would waste go to the other tensors. On the GAT example the input
# features are 55% of the saved elements; pinning them cut the prior allocation's true gradient
# error 15x (BENCHMARKS.md). A key whose tensor later takes more values is still rounded
# without bias, only with more variance.


# NOTE [Prior allocation]
# At the end of the first step, before any probe, an adaptive level allocates its budget as if
# every saved tensor were equally sensitive: the allocator then gives small tensors (normalisation
# statistics, attention denominators, logits) more bits, which cost little, and large ones fewer.
# Measured against the true per-tensor errors of the char-GPT and GAT examples (BENCHMARKS.md,
# "Why adaptive bits lost"), that allocation is 2-70x better than uniform widths at the same
# budget and better than an allocation probed at initialisation, whose sensitivities are not
# those of training. Probing adaptations follow the schedule, from ``adapt_first_gap`` on.
# The first step itself, before sizes are known, stores every tensor at the level's average net
# of metadata rounded up (``BitPlan.default_bits``: 4 bits for L2, 2 for L2.2), a step over the
# budget by less than a bit per element. Rounded down, L2.2's first step stored everything at 1
# bit, and that one gradient, 10^2-10^6 times fp32's on the model matrix's ViT and LLaMA-style
# decoder, inflated AdamW's second moments for hundreds of steps (BENCHMARKS.md, "Stability").


# NOTE [Keys the step did not save]
# A model may save different tensors on different steps: a block run on some steps only
# (multi-task heads, layer drop, a branch the data takes). An adaptation estimates and places
# the tensors its own step saved; the others keep the widths and sensitivities earlier
# adaptations gave them (before, they fell back to the level's default width and their
# sensitivities were forgotten). The budget is the step's: a step that saves tensors the last
# adapting step did not may store more than it (a block run on odd steps, adaptations on even
# ones: 67,140 bytes on those steps against a memory_budget of 40,000). Allocating every key
# ever seen under one budget was tried and dropped: branches that never run together then
# shared one budget (each collapsed to 1 bit where each step fitted alone), and at an average
# the bits that cheap absent keys left went to the others (twice the level's average on steps
# without them).


# NOTE [Held tensors]
# Measuring costs a fraction of a step; probing costs whole forward and backward passes, which
# the time budget (NOTE [Adaptation schedule] in gact_policy) may not afford for many steps:
# 4 probe runs take 100 steps of a 5% budget, the length of a GNN's whole training. So a step
# that measured (NOTE [Measuring steps] in pacing.py) and cannot afford the probes, or
# that has no closure to probe with (``controller.step()`` loops), still adapts: the tensors
# it measured share the bits left by the others, which are *held* at their widths (pinned in
# the allocation, their sensitivities unchanged). That allocation is the best one for the
# measured tensors, whose sensitivities are exact, given the held ones' widths. The probing
# adaptation stays due (``last_step`` does not move) and runs once the budget affords it;
# meanwhile the measured tensors are measured and re-allocated again on the schedule's steps
# counted from the last adaptation of any kind (NOTE [Measuring steps] in pacing.py). A
# ``step()`` loop that never called ``iterate(closure)``, and so cannot probe, moves on to the
# schedule's next adaptation.
# Measured tensors alone are the GNN examples' whole story once their messages are stored as
# shapes (NOTE [Shape-only saves] in decision_rules.py): GCN and GraphSAGE hold only their edge or
# degree normalisation, 0.1-7% of their elements.


class Adapter:
    """Estimates per-key sensitivities and allocates bits for the adaptive levels.

    Args:
        model: the model being trained.
        plan: the bit plan to update.
        hooks: the controller's hooks (their ledger is swapped out while probing).
    """

    def __init__(self, model: nn.Module, plan: BitPlan, hooks: SaveHooks) -> None:
        self._model = model
        self.batch_norms = has_batch_norm(model)  # NOTE [Measured BatchNorm inputs]
        self._plan = plan
        self._hooks = hooks
        self.count = 0
        self.seconds = 0.0  # spent adapting, all adaptations together
        # of which compiling (NOTE [Compile time] in compiled.py)
        self.compile_seconds = 0.0
        self.last_seconds = 0.0  # the last adaptation's cost: predicts the next one's
        self.last_step: int | None = None  # the last adaptation that probed what it needed
        self.last_adapted: int | None = None  # the last one of any kind, held ones included
        self.last_held_seconds = 0.0  # the last held adaptation's cost (NOTE [Held tensors])
        self.has_prior = False
        self._items = 0  # items of the last allocation (predicts the probe count)
        self.last_probed = 0  # items the last adaptation probed
        self.last_held = 0  # items the last adaptation held at their widths
        self._warned_budget = False

    def adapt(
        self,
        closure: Callable[[], Any] | None,
        sites: dict[str, SiteRecord],
        run_closure: Callable[[Callable[[], Any]], Any],
        meter: SensitivityMeter | None = None,
        *,
        probes_later: bool = True,
    ) -> bool:
        """Estimate sensitivities, update their smoothed values and re-allocate bits: measured
        for the keys ``meter`` measured in the step (NOTE [Measured sensitivities] in
        measured.py), probed by running ``closure`` for the others.

        Args:
            closure: forward + backward on the probe batch; ``None``: no probes run now, the
                items that need them are held at their widths (NOTE [Held tensors]).
            sites: the open step's records; every quantizable key among them is an item.
            run_closure: runs a closure and checks that it ran a backward.
            meter: what the step measured, or ``None`` (every item is probed).
            probes_later: with held items, keep the probing adaptation due (the schedule
                does not move on); ``False`` for loops that have never given a closure to
                probe with.

        Returns:
            Whether it adapted: ``False`` when items need probes and ``closure`` is ``None``.
        """
        plan, cfg = self._plan, self._plan.config
        items = Items.of(sites, cfg.overhead_bits, plan.two_valued)
        if not items.keys:
            return False
        start, compiling = time.perf_counter(), self._hooks.compile_clock.seconds
        found = self.estimate(items, closure, run_closure, meter)
        if found is None:
            return False
        value, stderr, probed, held = found
        # keys seen for the first time start from their own estimate
        previous = [plan.sensitivity.get(k, float(e)) for k, e in zip(items.keys, value)]
        sensitivity = gact_policy.smooth(previous, value, cfg.sensitivity_momentum)
        pins = items.pinned.copy()  # held items keep their widths (NOTE [Held tensors])
        # the width each held item was stored at: its allocation's, or for a key no
        # allocation placed yet, the default raised to its preferred width (SaveHooks._compress)
        default = np.maximum(plan.default_bits, items.preferred)
        current = [plan.bits.get(items.keys[i], int(default[i])) for i in held]
        pins[held] = np.maximum(current, items.lower[held])
        bits = self._allocate(dataclasses.replace(items, pinned=pins), sensitivity)
        fresh = {k: int(b) for k, b in zip(items.keys, bits)}
        # keys this step did not save keep their widths (NOTE [Keys the step did not save])
        plan.bits = {k: b for k, b in plan.bits.items() if k not in fresh} | fresh
        moved = np.setdiff1d(np.arange(len(items.keys)), held)
        known = [items.keys[i] for i in held.tolist() if items.keys[i] in plan.sensitivity]
        known += [k for k in plan.sensitivity if k not in fresh]
        plan.sensitivity = {k: plan.sensitivity[k] for k in known} | {
            items.keys[i]: float(sensitivity[i]) for i in moved.tolist()
        }
        plan.stderr = {k: plan.stderr.get(k, 0.0) for k in known} | {
            items.keys[i]: float(stderr[i]) for i in moved.tolist()
        }
        plan.measured = {items.keys[i] for i in np.setdiff1d(moved, probed).tolist()}
        self.count += 1
        self.has_prior = True  # an allocation exists: no prior needed any more
        self.last_held = int(held.size)
        spent = time.perf_counter() - start
        self.seconds += spent  # the meter's own time is counted by the controller
        self.compile_seconds += self._hooks.compile_clock.seconds - compiling
        cost = spent + (meter.seconds if meter is not None else 0.0)
        self.last_adapted = plan.step
        if not (held.size and probes_later):  # NOTE [Held tensors]: their probes stay due
            self.last_step = plan.step
            self.last_probed = int(probed.size)
            self.last_seconds = cost
        else:
            self.last_held_seconds = cost
        widths, counts = np.unique(np.where(bits > 8, 0, bits), return_counts=True)
        per_width = (
            f"{f'{w} bits' if w else 'full precision'}: {n}" for w, n in zip(widths, counts)
        )
        logger.info(
            "GACT adaptation %d at step %d: %d tensors (%d measured, %d probed, %d held) in "
            "%.3fs; tensors per width: %s",
            self.count,
            plan.step,
            len(items.keys),
            len(items.keys) - probed.size - held.size,
            probed.size,
            held.size,
            cost,
            ", ".join(per_width),
        )
        return True

    def allocate_prior(self, sites: dict[str, SiteRecord]) -> None:
        """The allocation made before any probe (see NOTE [Prior allocation]), or after a new
        budget (``Controller.configure``): from the sensitivities known if every item has one,
        else as if all were equal."""
        items = Items.of(sites, self._plan.config.overhead_bits, self._plan.two_valued)
        if not items.keys:
            return
        known = self._plan.sensitivity
        if all(k in known for k in items.keys):
            sensitivity = np.array([known[k] for k in items.keys])
        else:
            sensitivity = np.ones(len(items.keys))
        bits = self._allocate(items, sensitivity)
        self._plan.bits = {k: int(b) for k, b in zip(items.keys, bits)}
        self._items = len(items.keys)
        self.has_prior = True

    def estimate(
        self,
        items: Items,
        closure: Callable[[], Any] | None,
        run_closure: Callable[[Callable[[], Any]], Any],
        meter: SensitivityMeter | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Sensitivities of ``items`` and their standard errors: measured where ``meter``
        measured the key (0 for two-valued items, stored exactly), probed through ``closure``
        for the rest (floored: NOTE [Floored estimates] in gact_policy); the indices of the
        probed items; and those of the items held at their widths, unestimated, because they
        need probes and ``closure`` is ``None`` (NOTE [Held tensors]). ``None`` when no item
        could be estimated."""
        measured = rank_zeros(meter.sensitivities() if meter is not None else {})
        if measured:  # two-valued items are stored exactly at their pinned 1 bit
            measured.update({k: 0.0 for k, p in zip(items.keys, items.pinned) if p})
        rest = np.array([i for i, k in enumerate(items.keys) if k not in measured], np.int64)
        none = np.zeros(0, np.int64)
        value = np.array([measured.get(k, 0.0) for k in items.keys])
        stderr = np.zeros_like(value)
        if closure is None or not rest.size:
            return None if not measured else (value, stderr, none, rest)
        remeasured, estimate = self._probe(items, rest, closure, run_closure, measured)
        value[rest] = estimate.floored()
        stderr[rest] = estimate.stderr
        for i, k in enumerate(items.keys):  # in the probes' unit (their batch)
            value[i] = remeasured.get(k, value[i])
        return value, stderr, rest, none

    def unmeasured(self, sites: dict[str, SiteRecord], meter: SensitivityMeter) -> int:
        """How many of the step's items ``meter`` could not measure (they need probes)."""
        two_valued = self._plan.two_valued
        return sum(
            1
            for key, rec in sites.items()
            if _quantizable(rec)
            and not _two_valued(rec, two_valued)
            and (key not in meter.seen or key in meter.probed)
        )

    def predicted_cost(
        self, step_seconds: float, probe_fraction: float = 1.0, probed: int | None = None
    ) -> float:
        """Seconds of a first adaptation: its probes, each about ``probe_fraction`` of a
        training step (the probe batch's share of the step's), for ``probed`` items (default:
        every item of the last allocation); none when no item needs probes."""
        probed = self._items if probed is None else probed
        if probed == 0:
            return 0.0
        return (self._probes(probed) + 1) * probe_fraction * step_seconds

    def _probes(self, items: int) -> int:
        """Probe runs after the base run for ``items`` probed items: the pairwise method's
        ``K``, or ``items`` for the reference method, which the pairwise one falls back to
        when that is no more (up to 3 items by default): it estimates each item alone."""
        cfg = self._plan.config
        pairwise = max(cfg.num_probes or 0, gact_policy.min_pair_probes(items))
        return items if cfg.sensitivity_method == "probe" else min(items, pairwise)

    def _probe(
        self,
        items: Items,
        probed: np.ndarray,
        closure: Callable[[], Any],
        run_closure: Callable[[Callable[[], Any]], Any],
        measured: dict[str, float],
    ) -> tuple[dict[str, float], gact_policy.SensitivityEstimate]:
        """Probe the items ``probed`` (see NOTE [Probes leave no trace]), the others keeping
        their bits and seeds in every probe, and measure the ``measured`` keys again meanwhile
        (in the probes' unit); returns those measurements, averaged over the probes, and the
        probed items' estimates."""
        plan, cfg = self._plan, self._plan.config
        probe_bits = np.array(
            [min(plan.bits.get(k, plan.default_bits), 8) for k in items.keys], dtype=np.int64
        )
        probe_bits = np.maximum(probe_bits, items.lower)
        seed = mix_seed(cfg.seed, plan.step)
        base_seeds = np.array(
            [mix_seed(seed, 0xBA5E, i) >> 1 for i in range(len(items.keys))], dtype=np.uint64
        )  # the seeds of the items a probe does not re-seed
        meter = SensitivityMeter(batch_norms=self.batch_norms) if measured else None
        with ProbeSession(
            self._model, plan, self._hooks, closure, run_closure, items.keys, seed=seed,
            meter=meter,
        ) as session:  # fmt: skip

            def grad(probe: gact_policy.ProbeConfig) -> np.ndarray:
                bits, seeds = probe_bits.copy(), base_seeds.copy()
                bits[probed], seeds[probed] = probe.bits, probe.seeds
                return session.grad(bits, seeds)

            estimate = self._estimate(grad, probe_bits[probed])
            runs = session.runs
        if meter is None:
            return {}, estimate
        remeasured = rank_zeros(meter.sensitivities())  # each rank's g is its own shard's
        return {k: v / runs for k, v in remeasured.items() if k in measured}, estimate

    def _allocate(self, items: Items, sensitivity: np.ndarray) -> np.ndarray:
        """Widths minimising the predicted variance within the level's average or the
        configuration's ``memory_budget`` (bytes, everything the step stores counted)."""
        cfg = self._plan.config
        if cfg.memory_budget is None:  # the average covers the decided saves' elements too
            assert cfg.avg_bits is not None
            covered = int(items.numel.sum()) + items.decided_numel
            budget_bits = math.floor(cfg.avg_bits * covered) - items.decided_bits
            limit: dict[str, Any] = (
                {"avg_bits": None, "budget_bytes": max(budget_bits, 0) // 8}
                if items.decided_numel
                else {"avg_bits": cfg.avg_bits}  # the same budget, in the policy's own terms
            )
        else:
            # 16 bytes per item cover the rounding up of the last group's metadata and of the
            # decision masks to whole bytes, which the per-element costs leave out
            budget = cfg.memory_budget - items.fixed_bytes - 16 * len(items.keys)
            budget_bits, limit = 8 * budget, {"avg_bits": None, "budget_bytes": budget}
        least = 0
        for lower in preference_tiers(items.preferred, items.lower):
            costs = dict(
                full_bits=items.full_bits,
                overhead_bits=items.overhead_bits,
                lower=lower,
                pinned=items.pinned,
            )
            least = gact_policy.min_storage_bits(items.numel, **costs)
            if least <= budget_bits:
                return gact_policy.allocate_bits(sensitivity, items.numel, **limit, **costs)
        if cfg.memory_budget is None:
            problem = (
                f"level {cfg.level} averages {cfg.avg_bits} bits per element, but the smallest "
                f"widths of this model's saved tensors need {least / items.numel.sum():.3g}"
            )
        else:
            problem = (
                f"memory_budget={cfg.memory_budget} bytes cannot hold the step's saved tensors "
                f"even at their smallest widths (the tensors that cannot be quantized alone take "
                f"{items.fixed_bytes} bytes)"
            )
        if not self._warned_budget:
            self._warned_budget = True
            warnings.warn(
                f"{problem}; using the smallest widths (1 bit, 2 for ReLU outputs, 6 for the "
                "queries and keys a fused attention backward reads, plus metadata and exact "
                "decision masks). "
                "Choose a level with more bits or a larger budget.",
                GactWarning,
                stacklevel=4,
            )
        return np.where(items.pinned > 0, items.pinned, items.lower)

    def _estimate(
        self, grad: Callable[[Any], np.ndarray], bits: np.ndarray
    ) -> gact_policy.SensitivityEstimate:
        cfg = self._plan.config
        seed = mix_seed(cfg.seed, self._plan.step, 0x5E5) >> 1
        probes = self._probes(bits.size)
        if probes == bits.size:  # the reference method (see _probes)
            value = gact_policy.probe_sensitivity(grad, bits, seed=seed)
            return gact_policy.SensitivityEstimate(value, np.zeros_like(value))
        return gact_policy.pairwise_sensitivity(
            grad, bits, num_probes=probes, seed=seed, stderr=True
        )


# NOTE [Preference tiers]
# Preferred widths (NOTE [Small maps] in norm_rules.py) yield to the budget a bit at a time: the
# allocation takes the first of ``preferred``, ``preferred - 1``, ... (never below ``lower``)
# whose smallest storage fits, and allocates the rest of the budget above it by sensitivity.
# Yielding all at once dropped every small map's extra bits as soon as the level or the
# ``memory_budget`` could not hold all of them, although part of them fitted.


def preference_tiers(preferred: np.ndarray, lower: np.ndarray) -> Iterator[np.ndarray]:
    """The lower bounds an allocation tries in turn (NOTE [Preference tiers]): ``preferred``
    lowered by 0, 1, 2 ... bits, never below ``lower``; the last is ``lower`` itself."""
    steps = int((preferred - lower).max(initial=0))
    for k in range(steps + 1):
        yield np.maximum(lower, preferred - k)


def rank_zeros(value: Any) -> Any:
    """Rank 0's ``value`` on every rank of an initialised process group; ``value`` otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _two_valued(rec: SiteRecord, two_valued: dict[str, bool]) -> bool:
    """Whether an item is pinned at 1 bit (NOTE [Two-valued tensors]); a ReLU output is not:
    the zero-exact grid has 2 bits at least."""
    return bool(two_valued.get(rec.key)) and not rec.zero_exact


def _quantizable(rec: SiteRecord) -> bool:
    """Quantized now, or kept at full precision by a previous allocation."""
    return rec.kind is Kind.QUANTIZED or (
        rec.kind is Kind.KEPT and rec.bits is not None and rec.bits > 8
    )
