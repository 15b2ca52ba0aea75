"""Two builds of the CPU kernels against each other: same calls, same bytes, which is faster.

Loads a baseline build's ``_cpu`` module (for example one built from an earlier commit with
``pip wheel --no-deps packages/gact-kernels`` and unzipped) beside the installed one, checks
that both write the same codes, minima, steps and dequantized values, and times the raw
channel-run kernels on the feature maps of ``bench_kernels.py``, the calls of both builds
interleaved (median over ``--repeats`` rounds), each map in the layouts the wrapper reads in
place.

    python packages/gact-kernels/benchmarks/compare_builds.py --baseline OLD/_cpu*.so --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from types import ModuleType

import gact_kernels
import gact_kernels._cpu as current
import torch
from bench_kernels import FEATURE_MAPS, median_seconds
from gact_kernels._layout import channel_runs
from gact_kernels.quantize import DTYPE_CODES


def load_build(path: str) -> ModuleType:
    """A ``_cpu`` extension module from ``path``, beside the installed one."""
    spec = importlib.util.spec_from_file_location("_cpu", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"not an extension module: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(
    x: torch.Tensor, builds: dict[str, ModuleType], bits: int, repeats: int, threads: int
) -> dict[str, object] | None:
    """Median quantize and dequantize milliseconds of each build on ``x``'s channel runs, the
    calls interleaved (``bench_kernels.median_seconds``); ``None`` where the wrapper would not
    read ``x`` as channel runs in place.

    Raises:
        AssertionError: if the builds write different bytes or values.
    """
    q = gact_kernels.quantize(x, bits, seed=1, channel_dim=1)
    runs = channel_runs(x, 1, q.stored_numel // x.shape[1])
    if q.channel_dim is None or runs is None:
        return None
    dtype = DTYPE_CODES[x.dtype]
    outputs, fns = {}, {}
    for name, module in builds.items():
        data, lo, scale = (torch.empty_like(t) for t in (q.data, q.lo, q.scale))
        out = torch.empty_like(x)
        outputs[name] = (data, lo, scale, out)
        ptrs = (data.data_ptr(), lo.data_ptr(), scale.data_ptr())

        def quantize(module: ModuleType = module, ptrs: tuple = ptrs) -> None:
            module.quantize_runs(x.data_ptr(), dtype, *runs, q.group_size, bits, q.seed,
                                 q.zero_exact, *ptrs, threads)  # fmt: skip

        def dequantize(module: ModuleType = module, out: torch.Tensor = out) -> None:
            module.dequantize_runs(q.data.data_ptr(), q.lo.data_ptr(), q.scale.data_ptr(), *runs,
                                   q.group_size, bits, q.seed, q.zero_exact, dtype,
                                   out.data_ptr(), threads)  # fmt: skip

        fns[f"{name} quantize"], fns[f"{name} dequantize"] = quantize, dequantize
    seconds = median_seconds(fns, x.device, repeats)
    first, *others = outputs.values()
    for other in others:
        if not all(torch.equal(a, b) for a, b in zip(first, other)):
            raise AssertionError(f"the builds disagree on {list(x.shape)}")
    layout = "nchw" if x.is_contiguous() else "channels_last"
    ms = {name: 1e3 * t for name, t in seconds.items()}
    return {"shape": list(x.shape), "layout": layout, "runs": list(runs), "ms": ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="path of the baseline _cpu module")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=21, help="interleaved rounds of calls")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"baseline": load_build(args.baseline), "installed": current}
    rows = []
    print("| shape | layout | quantize ms, baseline / installed | dequantize ms |")
    print("|---|---|---|---|")
    for shape in FEATURE_MAPS:
        x = torch.randn(shape)
        for layout in (torch.contiguous_format, torch.channels_last):
            row = compare(
                x.contiguous(memory_format=layout), builds, args.bits, args.repeats, args.threads
            )
            if row is None:
                continue
            rows.append(row)
            ms: dict[str, float] = row["ms"]  # type: ignore[assignment]
            print(f"| {'x'.join(map(str, shape))} | {row['layout']} | "
                  f"{ms['baseline quantize']:.2f} / {ms['installed quantize']:.2f} | "
                  f"{ms['baseline dequantize']:.2f} / {ms['installed dequantize']:.2f} |",
                  flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
