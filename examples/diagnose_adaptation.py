"""Why adaptive bits can lose to uniform ones: sensitivity estimators against the truth.

For the char-GPT, GAT and BERT-classifier examples, the ResNet-18 layout and the LLaMA-style
decoder, at initialisation and after some fp32 training steps, this measures per saved tensor
(per *item*):

- the *true* effect of quantizing that tensor alone at 2, 4 and 8 bits, every other tensor kept
  at full precision: over ``--seeds`` rounding seeds, the gradient's variance (trace of the
  covariance), its squared bias ``|E g - g*|^2`` and its mean squared error against the exact
  fp32 gradient ``g*``;
- the runtime's estimate of the sensitivity ``c`` (variance = ``c S(b)``) as the adapter makes
  it (measured in the backward for tensors read linearly, pairwise probes for the rest: NOTE
  [Measured sensitivities]), the pairwise estimate of every tensor (the runtime before) and
  the reference (GACT Algorithm 1) estimate;
- which backward nodes read the tensor (its op kind);

and writes a JSON record plus Markdown tables: rank correlation of each estimator with the
truth, bias^2 against variance per op kind, and the bits each allocation gives.

    python examples/diagnose_adaptation.py --data ../shared/data --model char-gpt
    python examples/diagnose_adaptation.py --data ../shared/data --model gat --steps 0,100,250
    python examples/diagnose_adaptation.py --data ../shared/data --model bert --steps 0,300
    python examples/diagnose_adaptation.py --data ../shared/data --model resnet18 --steps 0,50,200
    python examples/diagnose_adaptation.py --data ../shared/data --model llama --steps 0,300
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gact_policy
import numpy as np
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from gact.adapt import Items
from gact.measured import SensitivityMeter
from gact.plan import mix_seed
from gact.probes import ProbeSession
from gact.saved import SavedCompressed
from gact_examples.data import load_char_corpus, load_passage_classes, load_planetoid
from gact_examples.models import GNN, CharGPT, bert_classifier, passages
from gact_examples.tasks import make_task

FULL = gact_policy.FULL_PRECISION
WIDTHS = (2, 4, 8)


def char_gpt_task(
    data: str, seed: int, layers: int | None
) -> tuple[torch.nn.Module, Callable, Callable]:
    """The char-GPT example's default model (``layers`` blocks, default 2), optimizer and a
    fixed probe batch."""
    corpus = load_char_corpus(data)
    ids = torch.from_numpy(corpus["train"])
    torch.manual_seed(seed)
    model = CharGPT(len(corpus["chars"]), 64, layers or 2, 4, 128, 0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(ids) - 65, (32,), generator=gen)
        chunk = ids[starts.unsqueeze(1) + torch.arange(65)]
        return chunk[:, :-1], chunk[:, 1:]

    probe = batch()

    def train_step() -> None:
        x, y = batch()
        model.train()
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()

    def closure() -> None:
        model.train()
        model.zero_grad()
        model(*probe)[1].backward()

    return model, train_step, closure


def gat_task(
    data: str, seed: int, layers: int | None
) -> tuple[torch.nn.Module, Callable, Callable]:
    """The GAT example on Cora (full batch; always two layers)."""
    d = load_planetoid(data, "cora")
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    train_idx = torch.from_numpy(d["train_idx"])
    graph, aux = GNN.prepare("gat", torch.from_numpy(d["edge_index"]), x.shape[0])
    torch.manual_seed(seed)
    model = GNN("gat", x.shape[1], 64, int(d["num_classes"]), 0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

    def closure() -> None:
        model.train()
        model.zero_grad()
        F.cross_entropy(model(x, graph, aux)[train_idx], y[train_idx]).backward()

    def train_step() -> None:
        closure()
        optimizer.step()

    return model, train_step, closure


def bert_task(
    data: str, seed: int, layers: int | None
) -> tuple[torch.nn.Module, Callable, Callable]:
    """The BERT classifier example's default model (``layers`` encoder layers, default 4) and
    optimizer (constant learning rate)."""
    task = load_passage_classes(data)
    cls, passage = len(task["vocab"]), task["test_x"].shape[1]
    ids, starts = torch.from_numpy(task["ids"]), torch.from_numpy(task["train_starts"])
    labels = torch.from_numpy(task["train_y"])
    torch.manual_seed(seed)
    model = bert_classifier(cls, int(labels.max()) + 1, length=passage, n_layer=layers or 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, len(starts), (32,), generator=gen)
        return passages(ids, starts[pick], passage, cls), labels[pick]

    probe = batch()

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.train()
        return F.cross_entropy(model(input_ids=x).logits, y)

    def train_step() -> None:
        optimizer.zero_grad()
        loss(*batch()).backward()
        optimizer.step()

    def closure() -> None:
        model.zero_grad()
        loss(*probe).backward()

    return model, train_step, closure


def study_task(
    name: str, lr: float, **sizes: int
) -> Callable[..., tuple[torch.nn.Module, Callable, Callable]]:
    """A task of the stability study (``gact_examples.tasks``): ``"resnet18"``, the ResNet-18
    layout on CIFAR-10 (SGD with momentum 0.9), or ``"llama"``, the LLaMA-style decoder on
    tiny-shakespeare characters (AdamW), at learning rate ``lr``, with ``sizes`` (images,
    batch_size); ``layers`` is ignored (their own depths)."""

    def task_of(
        data: str, seed: int, layers: int | None
    ) -> tuple[torch.nn.Module, Callable, Callable]:
        task = make_task(name, argparse.Namespace(data=data, **sizes))
        torch.manual_seed(seed)
        model = task.build()
        optimizer = task.optimizer(model, lr)
        batches = task.batches(torch.Generator().manual_seed(seed))
        probe = next(batches)

        def train_step() -> None:
            model.train()
            optimizer.zero_grad()
            task.loss(model, next(batches)).backward()
            optimizer.step()

        def closure() -> None:
            model.train()
            model.zero_grad()
            task.loss(model, probe).backward()

        return model, train_step, closure

    return task_of


TASKS = {
    "char-gpt": char_gpt_task,
    "gat": gat_task,
    "bert": bert_task,
    "resnet18": study_task("resnet18", 0.05, images=4096, batch_size=64),
    "llama": study_task("llama", 1e-3, batch_size=32),
}


def consumers_of(controller: Controller, closure: Callable[[], None]) -> dict[str, set[str]]:
    """Which backward nodes read each compressed save of one real step."""
    seen: dict[str, set[str]] = {}
    unpack = SavedCompressed.unpack

    def spy(self: SavedCompressed) -> torch.Tensor:
        node = torch._C._current_autograd_node()
        seen.setdefault(self.key, set()).add(type(node).__name__.rstrip("0123456789"))
        return unpack(self)

    SavedCompressed.unpack = spy  # type: ignore[method-assign]
    try:
        controller.run_closure(closure)
    finally:
        SavedCompressed.unpack = unpack  # type: ignore[method-assign]
    return seen


def truth(session: ProbeSession, n_items: int, seeds: int) -> dict[str, Any]:
    """Per item and width: variance, bias^2 and MSE of the gradient with that item alone
    quantized, against the exact gradient (all items at full precision)."""
    full = np.full(n_items, FULL, dtype=np.int64)
    zero_seeds = np.zeros(n_items, dtype=np.uint64)
    exact = session.grad(full, zero_seeds)
    out = {f"{w}": {"var": [], "bias2": [], "mse": []} for w in WIDTHS}
    for item in range(n_items):
        for w in WIDTHS:
            bits = full.copy()
            bits[item] = w
            grads = np.stack(
                [
                    session.grad(bits, np.full(n_items, mix_seed(item, w, s), dtype=np.uint64))
                    for s in range(seeds)
                ]
            )
            mean = grads.mean(0)
            var = float(((grads - mean) ** 2).sum() / (seeds - 1))
            bias2 = max(float(((mean - exact) ** 2).sum()) - var / seeds, 0.0)
            mse = float(((grads - exact) ** 2).sum(1).mean())
            for name, value in (("var", var), ("bias2", bias2), ("mse", mse)):
                out[f"{w}"][name].append(value)
    out["exact_norm2"] = float(exact @ exact)
    return out


def estimates(session: ProbeSession, bits: np.ndarray, seed: int) -> dict[str, list[float]]:
    """The adapter's pairwise estimate and the reference (Algorithm 1) estimate of ``c``."""

    def grad(cfg: gact_policy.ProbeConfig) -> np.ndarray:
        return session.grad(cfg.bits, cfg.seeds)

    k = gact_policy.min_pair_probes(bits.size)
    runs = session.runs
    pairwise = gact_policy.pairwise_sensitivity(grad, bits, num_probes=k, seed=seed, stderr=True)
    pair_runs = session.runs - runs
    reference = gact_policy.probe_sensitivity(grad, bits, seed=seed + 1)
    ref_runs = session.runs - runs - pair_runs
    exact_pairs = {
        f"{w}": pairwise_vs_exact(grad, np.full_like(bits, w), k, seed + 2).tolist() for w in (2, 4)
    }
    return {
        "pairwise": pairwise.value.tolist(),
        "pairwise_stderr": pairwise.stderr.tolist(),
        "reference": reference.tolist(),
        "pairwise_exact": exact_pairs,
        "pairwise_probes": pair_runs,
        "reference_probes": ref_runs,
    }


def runtime_estimate(
    controller: Controller, items: Items, closure: Callable[[], None], bits: np.ndarray, seed: int
) -> dict[str, Any]:
    """The adapter's estimate (``Adapter.estimate``): one run measures what the training step
    would (the keys read linearly), probes estimate the rest."""
    with ProbeSession(
        controller.model, controller.plan, controller.hooks, closure, controller.run_closure,
        items.keys, seed=seed, meter=SensitivityMeter(),
    ) as session:  # fmt: skip
        session.grad(bits, np.zeros(bits.size, dtype=np.uint64))  # the training step
    runs = [0]

    def counted() -> None:
        runs[0] += 1
        closure()

    found = controller.adapter.estimate(items, counted, controller.run_closure, session.meter)
    assert found is not None  # a closure is given
    value, stderr, probed, _ = found  # nothing is held: a closure is given
    return {
        "runtime": value.tolist(),
        "runtime_stderr": stderr.tolist(),
        "runtime_probes": runs[0],
        "measured": [i not in set(probed.tolist()) for i in range(len(items.keys))],
    }


def pairwise_vs_exact(
    grad: Callable[[gact_policy.ProbeConfig], np.ndarray], bits: np.ndarray, k: int, seed: int
) -> np.ndarray:
    """Candidate estimator: probe j quantizes only its items (the rest at full precision), each
    item with the same seed in both of its probes; against the exact gradient, the inner
    product of the two probes that share item l estimates its mean squared error (variance and
    bias^2) up to cross terms; divided by S(b) as a sensitivity."""
    n = bits.size
    rng = np.random.default_rng(seed)
    pairs = np.array(gact_policy.sensitivity._pairs(k, n))[rng.permutation(n)]
    seeds = rng.integers(0, 2**63, n, dtype=np.uint64)
    full = np.full(n, FULL, dtype=np.int64)
    exact = grad(gact_policy.ProbeConfig(full, seeds))
    diffs = []
    for j in range(k):
        b = full.copy()
        items = np.flatnonzero((pairs == j).any(1))
        b[items] = bits[items]
        diffs.append(grad(gact_policy.ProbeConfig(b, seeds)) - exact)
    e = np.stack(diffs)
    gram = e @ e.T
    return gram[pairs[:, 0], pairs[:, 1]] / gact_policy.variance_factor(bits)


def diagnose(model: torch.nn.Module, closure: Callable[[], None], args: argparse.Namespace,
             step: int) -> dict[str, Any]:  # fmt: skip
    cfg = GactConfig.from_level("L2", min_numel=args.min_numel, seed=args.seed)
    controller = Controller(model, cfg)
    with controller:
        consumers = consumers_of(controller, closure)
        items = Items.of(controller.ledger.current, cfg.overhead_bits, controller.plan.two_valued)
        probe_bits = np.full(len(items.keys), controller.plan.default_bits, dtype=np.int64)
        start = time.perf_counter()
        runtime = runtime_estimate(controller, items, closure, probe_bits, args.seed + step)
        runtime["seconds"] = time.perf_counter() - start
        with ProbeSession(
            model, controller.plan, controller.hooks, closure, controller.run_closure,
            items.keys, seed=mix_seed(args.seed, step), sketch_width=1 << 26,
        ) as session:  # fmt: skip
            assert session.sketch.exact
            start = time.perf_counter()
            est = estimates(session, probe_bits, seed=args.seed + step)
            est.update(runtime)
            true = truth(session, len(items.keys), args.seeds)
            seconds = time.perf_counter() - start
        controller.step()
    return {
        "step": step,
        "keys": items.keys,
        "numel": items.numel.tolist(),
        "mask_bits": (items.overhead_bits - cfg.overhead_bits).tolist(),
        "lower": items.lower.tolist(),
        "pinned": items.pinned.tolist(),
        "consumers": [sorted(consumers.get(k, ())) for k in items.keys],
        "probe_bits": int(probe_bits[0]),
        "estimates": est,
        "truth": true,
        "seconds": seconds,
    }


# ------------------------------------------------------------------------------ report


def _c(rec: dict[str, Any], width: int, what: str = "mse") -> np.ndarray:
    return np.maximum(np.array(rec["truth"][str(width)][what]), 0.0) / gact_policy.variance_factor(
        width
    )


def _floored(rec: dict[str, Any]) -> np.ndarray:
    """The pairwise estimates as the runtime uses them (NOTE [Floored estimates])."""
    est = rec["estimates"]
    value = np.array(est["pairwise"])
    stderr = np.array(est.get("pairwise_stderr", np.zeros_like(value)))
    return gact_policy.SensitivityEstimate(value, stderr).floored()


def true_mse(rec: dict[str, Any], bits: np.ndarray) -> float:
    """True extra squared error of an allocation, from the per-item truth at the nearest
    measured width (2, 4 or 8), scaled by S(b) between measured widths."""
    total = 0.0
    for i, b in enumerate(bits):
        if b > 8:
            continue
        w = 2 if b <= 2 else (4 if b <= 5 else 8)
        total += float(_c(rec, w)[i]) * gact_policy.variance_factor(int(b))
    return total


def report(paths: list[str], plot_path: str | None) -> str:
    """Markdown tables (and a PNG) from the JSON records of ``main``."""
    from scipy.stats import spearmanr

    lines = ["| model | step | items | runtime: measured, probes, rank corr. | pairwise: probes, "
             "rank corr. | reference: probes, rank corr. | bias^2 / variance at 2, 4, 8 bits |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    kinds: dict[tuple[str, int], list[float]] = {}
    alloc_rows: list[str] = []
    item_rows: list[str] = []
    data = [json.loads(Path(p).read_text()) for p in paths]
    for d in data:
        recs = d["records"]
        n = np.array(recs[0]["numel"])
        for rec in recs:
            est, truth4 = rec["estimates"], _c(rec, 4)
            rho = [
                spearmanr(est[k], truth4).correlation for k in ("runtime", "pairwise", "reference")
            ]
            ratios = []
            for w in WIDTHS:
                var, bias2 = (np.array(rec["truth"][str(w)][k]) for k in ("var", "bias2"))
                ratios.append(bias2.sum() / max(var.sum(), 1e-30))
                for i, kind in enumerate(rec["consumers"]):
                    if var[i] < 1e-6 * var.max():
                        continue  # no effect on the gradient (e.g. read only by exact decisions)
                    for node in kind:
                        kinds.setdefault((node, w), []).append(bias2[i] / var[i])
            lines.append(
                f"| {d['model']} | {rec['step']} | {len(rec['keys'])} | "
                f"{sum(est['measured'])}, {est['runtime_probes']}, {rho[0]:.2f} | "
                f"{est['pairwise_probes']}, {rho[1]:.2f} | {est['reference_probes']}, "
                f"{rho[2]:.2f} | {', '.join(f'{r:.3g}' for r in ratios)} |"
            )
        late = recs[-1]

        def alloc(c: np.ndarray, n: np.ndarray = n, late: dict[str, Any] = recs[-1]) -> np.ndarray:
            """L2's allocation for sensitivities ``c``, with the runtime's smallest widths and
            pinned two-valued items where the record has them."""
            c = np.maximum(np.asarray(c, dtype=float), 1e-12)
            limits = {k: np.array(late[k]) for k in ("lower", "pinned") if k in late}
            return gact_policy.allocate_bits(c, n, 4.0, overhead_bits=0.25, **limits)

        candidates = {
            "uniform 3 bits": np.full(n.size, 3),
            "uniform 4 bits (L1, 6% more memory)": np.full(n.size, 4),
            "prior (equal sensitivities)": alloc(np.ones(n.size)),
            "probed at step 0 (pairwise, as the runtime)": alloc(_floored(recs[0])),
            "probed at step 0 (true)": alloc(_c(recs[0], 4)),
            f"probed at step {late['step']} (pairwise, as the runtime)": alloc(_floored(late)),
            f"optimal at step {late['step']} (true)": alloc(_c(late, 4)),
            f"measured and probed at step {late['step']} (the runtime now)": alloc(
                late["estimates"]["runtime"]
            ),
        }
        for name, bits in candidates.items():
            alloc_rows.append(f"| {d['model']} | {name} | {true_mse(late, bits):.3g} |")
        item_rows += per_item_rows(d["model"], recs, candidates)
    lines += ["", "| op that reads the tensor | bias^2 / variance at 2 bits | at 4 bits | at 8 bits |",
              "|---|---|---|---|"]  # fmt: skip
    for node in sorted({k for k, _ in kinds}):
        med = [np.median(kinds.get((node, w), [np.nan])) for w in WIDTHS]
        lines.append(f"| {node} | " + " | ".join(f"{m:.3g}" for m in med) + " |")
    lines += ["", "| model | allocation (L2 budget unless noted) | true extra squared error at "
              "the last step |", "|---|---|---|", *alloc_rows]  # fmt: skip
    steps = "/".join(str(r["step"]) for r in data[0]["records"])
    lines += ["", f"| model | tensor | read by | elements | true c at steps {steps} | "
              "runtime, pairwise, reference at the last step | bits: prior, probed at 0, probed "
              "last, the runtime now, optimal |", "|---|---|---|---|---|---|---|", *item_rows]  # fmt: skip
    if plot_path:
        _plot(data, plot_path)
    return "\n".join(lines)


def per_item_rows(model: str, recs: list[dict[str, Any]], bits: dict[str, np.ndarray]) -> list[str]:
    """One row per item: its true sensitivity at every measured step, the two estimates at the
    last step and the width each allocation gives it (``bits``: the candidates of ``report``)."""
    late, names = recs[-1], list(bits)
    # prior, probed at 0 and last, the runtime now, optimal
    picks = [names[2], names[3], names[5], names[7], names[6]]
    rows = []
    for i, key in enumerate(late["keys"]):
        truth = "/".join(f"{_c(r, 4)[i]:.2g}" for r in recs)
        est = late["estimates"]
        nodes = ", ".join(late["consumers"][i]) or "-"
        widths = ", ".join(str(int(bits[n][i])) if bits[n][i] <= 8 else "32" for n in picks)
        how = "measured" if est["measured"][i] else "probed"
        rows.append(
            f"| {model} | `{key}` | {nodes} | {late['numel'][i]:,} | {truth} | "
            f"{est['runtime'][i]:.2g} ({how}), {est['pairwise'][i]:.2g}, "
            f"{est['reference'][i]:.2g} | {widths} |"
        )
    return rows


def _plot(data: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data) + 1, figsize=(5.2 * (len(data) + 1), 4.6))
    for ax, d in zip(axes, data):
        rec = d["records"][-1]
        truth = _c(rec, 4)
        series = {
            "pairwise": rec["estimates"]["pairwise"],
            "pairwise, floored (the runtime before)": _floored(rec),
            "reference": rec["estimates"]["reference"],
            "measured + pairwise (the runtime)": rec["estimates"]["runtime"],
        }
        for (label, values), mark in zip(series.items(), ("o", ".", "x", "+")):
            ax.scatter(truth, np.maximum(values, 1e-9), marker=mark, label=label)
        lo, hi = truth[truth > 0].min(), truth.max()
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="true sensitivity (MSE / S(4))",
               ylabel="estimate", title=f"{d['model']}, step {rec['step']}")  # fmt: skip
        ax.legend()
    ax = axes[-1]
    d = data[0]
    first, last = (_c(r, 4) for r in (d["records"][0], d["records"][-1]))
    ax.scatter(np.maximum(first, 1e-9), np.maximum(last, 1e-9))
    ax.plot([1e-9, 10], [1e-9, 10], "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="true sensitivity at step 0",
           ylabel=f"at step {d['records'][-1]['step']}",
           title=f"{d['model']}: sensitivities move")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data")
    p.add_argument("--model", choices=sorted(TASKS), default="char-gpt")
    p.add_argument("--steps", default="0,100,250", help="fp32 training steps at which to measure")
    p.add_argument("--seeds", type=int, default=8, help="rounding seeds per item and width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="char-gpt, bert: model depth")
    p.add_argument("--min-numel", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="diagnose.json")
    p.add_argument("--report", nargs="+", metavar="JSON", help="print tables from records")
    p.add_argument("--plot", default=None, help="with --report: write a PNG here")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.report, args.plot))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    model, train_step, closure = TASKS[args.model](args.data, args.seed, args.layers)
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    records, done = [], 0
    for step in checkpoints:
        for _ in range(step - done):
            train_step()
        done = step
        rec = diagnose(model, closure, args, step)
        records.append(rec)
        print(f"{args.model} step {step}: {len(rec['keys'])} items, {rec['seconds']:.0f}s")
        Path(args.out).write_text(json.dumps({"model": args.model, "records": records}))


if __name__ == "__main__":
    main()
