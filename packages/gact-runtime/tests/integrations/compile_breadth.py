"""Every architecture of ``hf_architectures.py`` compiled under GACT: does it compile, does it
compress what eager code compresses, and does its gradient point where the exact one does.

For each model (seed 0, one training step each way): the L1 ratio of ``stats()`` eager and
compiled (``model.compile(backend=...)``), the cosine of one L1 gradient with the exact one,
the ``GactWarning`` messages, and the compiled sites kept for a reason other than their size.
Prints a markdown table and writes the rows as JSON::

    python packages/gact-runtime/tests/integrations/compile_breadth.py --backend aot_eager \
        --out breadth.json
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import torch
from gact import Controller, GactConfig
from hf_architectures import ARCHITECTURES, build

__all__ = ["measure"]


def _gradient(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    return torch.cat(grads).double()


def _run(model_type: str, backend: str | None) -> dict[str, Any]:
    torch._dynamo.reset()
    model, loss_fn = build(model_type)
    if backend is not None:
        model.compile(backend=backend)
    torch.manual_seed(0)
    loss_fn().backward()
    exact = _gradient(model)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()  # a graph compiled without the hooks would run without them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        with Controller(model, GactConfig.from_level("L1")) as controller:
            loss_fn().backward()
            controller.step()
    grad = _gradient(model)
    kept = [
        f"{site.key.split(':')[0]}: {site.keep}"
        for site in controller.hooks.compiled_sites.values()
        if site.keep is not None and "min_numel" not in site.keep
    ]
    return {
        "ratio": controller.stats()["ratio"],
        "cosine": float(grad @ exact / (grad.norm() * exact.norm())),
        "warnings": sorted(
            {str(w.message) for w in caught if w.category.__name__ == "GactWarning"}
        ),
        "kept": kept,
    }


def measure(model_type: str, backend: str) -> dict[str, Any]:
    """One row: ``model_type`` eager and compiled with ``backend`` (or the error it raised)."""
    row: dict[str, Any] = {"model": model_type, "backend": backend}
    try:
        row["eager"] = _run(model_type, None)
        row["compiled"] = _run(model_type, backend)
    except Exception as error:  # a row per model: one failure does not end the sweep
        row["error"] = f"{type(error).__name__}: {error}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    parser.add_argument("--models", default=",".join(ARCHITECTURES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| model | eager L1 ratio | compiled | cosine eager, compiled | kept (not for size) | warnings |"
    )
    print("|---|---:|---:|---|---:|---:|")
    rows = []
    for name in args.models.split(","):
        row = measure(name, args.backend)
        rows.append(row)
        if "error" in row:
            print(f"| {name} | | | {' '.join(row['error'].split())[:160]} | | |", flush=True)
            continue
        eager, compiled = row["eager"], row["compiled"]
        print(
            f"| {name} | {eager['ratio']:.2f}x | {compiled['ratio']:.2f}x | "
            f"{eager['cosine']:.4f}, {compiled['cosine']:.4f} | {len(compiled['kept'])} | "
            f"{len(compiled['warnings'])} |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
