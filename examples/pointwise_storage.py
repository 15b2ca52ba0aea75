"""Storing a GELU/SiLU input for its backward: the quantized input (GACT) or a few-bit derivative.

The backward of ``y = f(x)`` reads ``x`` only through ``f'(x)``. GACT stores ``x`` at ``b`` bits
with unbiased stochastic rounding and the backward computes ``f'(x^)``: its error is variance
plus a bias, since ``f'`` is nonlinear. Few-bit backward (Novikov et al., ICML 2022) stores which
of ``2^b`` intervals of ``x`` each element falls in, and a table of ``2^b`` derivative values: the
optimal piecewise-constant ``f'``, found by dynamic programming, deterministic.

For each input set (``N(0, 1)``; the char-GPT example's GELU inputs at initialisation and after
``--steps`` training steps) and ``b = 1..4`` this prints the relative mean squared error of the
input gradient ``g f'(.)`` against the exact one, ``E[(f~' - f')^2] / E[f'^2]`` (``g`` independent
of ``x``), with GACT's split into bias^2 and variance over ``--seeds`` rounding seeds. Few-bit is
shown twice: with intervals fitted on the tensor itself (its best case) and with the table fitted
once on ``N(0, 1)``: the runtime's own table (``gact.pointwise``, NOTE [Derivative tables]).

    python examples/pointwise_storage.py --data ../shared/data --json pointwise.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import gact_kernels
import gact_policy
import torch
from gact.pointwise import DERIVATIVES, MAX_TABLE_BITS, derivative_table
from gact_examples.data import load_char_corpus
from gact_examples.models import CharGPT
from torch import nn

FUNCTIONS = {"GELU": "gelu", "SiLU": "silu"}  # shown name -> gact.pointwise.DERIVATIVES key
WIDTHS = tuple(range(1, MAX_TABLE_BITS + 1))


def derivative(function: str, x: torch.Tensor) -> torch.Tensor:
    """``f'(x)`` elementwise, in float64."""
    return DERIVATIVES[function][0](x.double())


def fit_intervals(
    function: str, sample: torch.Tensor, bits: int, bins: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Few-bit's table fitted on ``sample`` itself: ``2**bits`` intervals with edges on ``bins``
    quantiles of the sample, and their mean derivative (``gact_policy.fit_piecewise_constant``
    over the bins' means, weighted by their counts)."""
    xs = torch.sort(sample.detach().double().flatten())[0]
    stride = max(1, xs.numel() // 100_000)
    edges = torch.quantile(xs[::stride], torch.linspace(0, 1, bins + 1)[1:-1].double())
    which = torch.bucketize(xs, edges)
    d = derivative(function, xs)
    counts = torch.bincount(which, minlength=bins).double()
    means = torch.zeros(bins, dtype=torch.float64).index_add_(0, which, d) / counts.clamp(min=1)
    fit = gact_policy.fit_piecewise_constant(means.numpy(), 2**bits, weights=counts.numpy())
    bounds = edges[torch.as_tensor(fit.starts[1:]) - 1]
    return bounds, torch.as_tensor(fit.levels)


def errors(function: str, x: torch.Tensor, seeds: int) -> list[dict[str, Any]]:
    """Per width: GACT's bias², variance and MSE, and the two tables' errors, relative."""
    exact = derivative(function, x)
    power = float((exact * exact).mean())
    rows = []
    for bits in WIDTHS:
        draws = torch.stack(
            [
                derivative(
                    function, gact_kernels.dequantize(gact_kernels.quantize(x, bits, seed=s))
                )
                for s in range(seeds)
            ]
        )
        mean = draws.mean(0)
        bias2 = float(((mean - exact) ** 2).mean()) / power
        var = float(draws.var(0).mean()) / power
        runtime = derivative_table(function, bits)
        fewbit = {}
        tables = {"own": fit_intervals(function, x, bits), "n01": (runtime.bounds, runtime.levels)}
        for name, (bounds, levels) in tables.items():
            approx = levels[torch.bucketize(x.double(), bounds)]
            fewbit[name] = float(((approx - exact) ** 2).mean()) / power
        rows.append(
            {
                "bits": bits,
                "gact_bias2": bias2,
                "gact_variance": var,
                "gact_mse": bias2 + var,
                "fewbit_own": fewbit["own"],
                "fewbit_n01": fewbit["n01"],
            }
        )
    return rows


def char_gpt_inputs(data: str, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """The GELU inputs of the char-GPT example's default model on one batch, at initialisation
    and after ``steps`` AdamW steps."""
    corpus = load_char_corpus(data)
    ids = torch.from_numpy(corpus["train"])
    torch.manual_seed(seed)
    model = CharGPT(len(corpus["chars"]), 64, 2, 4, 128, 0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(ids) - 65, (32,), generator=gen)
        chunk = ids[starts.unsqueeze(1) + torch.arange(65)]
        return chunk[:, :-1], chunk[:, 1:]

    captured: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, nn.GELU):
            module.register_forward_hook(lambda m, inp, out: captured.append(inp[0].detach()))
    probe = batch()
    out = {}
    for step in range(steps + 1):
        if step in (0, steps):
            captured.clear()
            model.eval()
            with torch.no_grad():
                model(*probe)
            out[f"char-GPT GELU input, step {step}"] = torch.cat([c.flatten() for c in captured])
        if step < steps:
            x, y = batch()
            model.train()
            optimizer.zero_grad()
            model(x, y)[1].backward()
            optimizer.step()
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the folder holding tinyshakespeare/")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--seeds", type=int, default=16, help="rounding seeds for GACT's bias/variance")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    normal = torch.randn(1 << 20)
    inputs = {"N(0, 1)": normal, **char_gpt_inputs(args.data, args.steps, seed=0)}
    results = []
    print(
        "| input | f | bits | GACT: bias^2 | variance | MSE | few-bit, own intervals | few-bit, N(0,1) table |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for fname, function in FUNCTIONS.items():
        for iname, x in inputs.items():
            if fname != "GELU" and iname != "N(0, 1)":
                continue  # the example has GELUs only
            for row in errors(function, x.float(), args.seeds):
                results.append({"input": iname, "function": fname, **row})
                print(
                    f"| {iname} | {fname} | {row['bits']} | {row['gact_bias2']:.2e} | "
                    f"{row['gact_variance']:.2e} | {row['gact_mse']:.2e} | "
                    f"{row['fewbit_own']:.2e} | {row['fewbit_n01']:.2e} |"
                )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
