"""Throughput of gact_kernels beside ``x.clone()``; sizes of packed integer tensors.

Quantisation: for each available device, input dtype (fp32, fp16, bf16; 64 MiB by default) and
width (1-8 bits) it times, as the median of several interleaved repeats: ``x.clone()``,
``quantize``, ``dequantize`` and the pure-torch reference of both. GB/s counts the bytes each
operation moves (reads plus writes): copy 2*N*s; quantize N*s + packed + 8 bytes/group;
dequantize the reverse. ``rt/copy`` is the median over rounds of (quantize + dequantize) / copy
timed in the same round, ``vs 4b`` the median round trip over the 4-bit one's (the widths are
timed one after the other; ``--only paths`` interleaves them). Targets (reported, not asserted):
CPU round trip <= 1.3x the copy in fp32 and <= 2x in fp16/bf16, widths 1-7 within 10% of 4 bits
(8 bits packs nothing and stores twice the codes), >= 10x faster than the reference; CUDA
quantize and dequantize >= 70% of copy bandwidth. Every call allocates its output, as a user's
does: with the default C allocator a 64 MiB output is a fresh mapping whose first touch (page
faults) costs about as much as the copy itself; run with ``MALLOC_MMAP_THRESHOLD_=4294967296
MALLOC_TRIM_THRESHOLD_=68719476736`` for the kernels' compute beside reused memory.

Packing paths (``--only paths``; CPUs with AVX-512 VBMI): per dtype and width, the round trip on
the VBMI path and on the portable one (NOTE [odd widths] in csrc/cpu_pack.h), interleaved in one
process, each over the portable 4-bit one.

Integer packing: the int64 indices of a ResNet stem max-pool (3x3, stride 2, on a
(32, 64, 112, 112) activation, NCHW and channels-last) and GPT-2-sized token ids: bytes before
and after ``pack_ints``, and ``pack_ints`` / ``unpack_ints`` time as a share of ``x.clone()``.

Zero-exact mode (``quantize(..., zero_exact=True)``) on ReLU-like data (half zeros at random
positions, half |N(0, 1)|; every group holds a zero, so every group uses the sign-exact grid),
per dtype and width (2, 3, 4, 8 bits): its quantize and dequantize time over the normal mode's
(median of the per-round ratios, both modes interleaved in one process); the mean squared
error of the round trip in both modes (over the positive elements, mean of a few seeds) and
its ratio, beside the expected ((2^b - 1) / (2^b - 2))^2; and the share of positive elements
the normal grid restores as 0 (the sign flips the mode removes; 0 in the mode, checked).

Channel groups (``quantize(..., channel_dim=1)``) of the feature maps a CNN saves (the ResNet-18
layout on CIFAR-10 at batch 64, the MNIST example's memory configuration at batch 512), NCHW
and channels-last, at 4 bits: ``x.clone()``, quantize and dequantize with channel groups, and
the same tensor in memory-order groups (``channel_dim=None``), the kernels' fastest path, as
the baseline of what keeping each group inside one channel costs.

Usage:
    python packages/gact-kernels/benchmarks/bench_kernels.py [--json results.json] [--devices cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Hashable
from typing import Callable

import gact_kernels
import torch
import torch.nn.functional as F
from gact_kernels.reference import reference_dequantize, reference_quantize

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def interleaved_seconds(
    fns: dict[Hashable, Callable[[], object]], device: torch.device, repeats: int
) -> dict[Hashable, list[float]]:
    """Wall times of each function over ``repeats`` rounds, after a warm-up run.

    The functions are timed in interleaved rounds, so that a machine whose load changes during
    the run (shared CI runners) skews all of them alike.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[Hashable, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        _timed(fn, sync)
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn, sync))
    return times


def median_seconds(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int
) -> dict[str, float]:
    """Median wall time of each function over interleaved rounds (see interleaved_seconds)."""
    times = interleaved_seconds(fns, device, repeats)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_ratio(times: dict[Hashable, list[float]], num: Hashable, den: Hashable) -> float:
    """Median over rounds of time[num] / time[den] (the two were timed in the same round)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def bench_one(x: torch.Tensor, bits: int, repeats: int, ref_repeats: int) -> dict[str, object]:
    n, size = x.numel(), x.numel() * x.element_size()
    q = gact_kernels.quantize(x, bits, seed=1)
    times = interleaved_seconds(
        {
            "copy": x.clone,
            "quantize": lambda: gact_kernels.quantize(x, bits, seed=1),
            "dequantize": lambda: gact_kernels.dequantize(q),
        },
        x.device,
        repeats,
    )
    ours = {name: statistics.median(ts) for name, ts in times.items()}
    ref = median_seconds(
        {
            "quantize": lambda: reference_quantize(x, bits, seed=1),
            "dequantize": lambda: reference_dequantize(q),
        },
        x.device,
        ref_repeats,
    )
    copy_s, quant_s, dequant_s = ours["copy"], ours["quantize"], ours["dequantize"]
    round_trips = [a + b for a, b in zip(times["quantize"], times["dequantize"])]
    moved = size + q.nbytes
    return {
        "device": x.device.type,
        "dtype": str(x.dtype).replace("torch.", ""),
        "bits": bits,
        "numel": n,
        "copy_ms": copy_s * 1e3,
        "quantize_ms": quant_s * 1e3,
        "dequantize_ms": dequant_s * 1e3,
        "round_trip_times": round_trips,
        "ref_quantize_ms": ref["quantize"] * 1e3,
        "ref_dequantize_ms": ref["dequantize"] * 1e3,
        "copy_GBps": 2 * size / copy_s / 1e9,
        "quantize_GBps": moved / quant_s / 1e9,
        "dequantize_GBps": moved / dequant_s / 1e9,
        "round_trip_over_copy": statistics.median(
            t / c for t, c in zip(round_trips, times["copy"])
        ),
        "speedup_over_reference": (ref["quantize"] + ref["dequantize"]) / (quant_s + dequant_s),
        "bandwidth_fraction": min(moved / quant_s, moved / dequant_s) / (2 * size / copy_s),
    }


def _devices(args: argparse.Namespace) -> list[torch.device]:
    """The devices of ``--devices`` that this machine has (CUDA: a GPU and the CUDA module)."""
    cuda = torch.cuda.is_available() and gact_kernels.compiled_with_cuda()
    return [torch.device(d) for d in args.devices if d == "cpu" or cuda]


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for device in _devices(args):
        for name in args.dtypes:
            dtype = DTYPES[name]
            numel = args.size_mib * 2**20 // torch.empty((), dtype=dtype).element_size()
            x = torch.randn(numel, device=device).to(dtype)
            mine = []
            for bits in args.bits:
                mine.append(bench_one(x, bits, args.repeats, args.ref_repeats))
            four = next((r["round_trip_times"] for r in mine if r["bits"] == 4), None)
            for r in mine:  # each width's round trip over the 4-bit one (timed in other rounds)
                rt = statistics.median(r.pop("round_trip_times"))
                r["round_trip_over_4_bits"] = rt / statistics.median(four) if four else None
                print_row(r)
            rows += mine
            del x
    return rows


HEADER = (
    f"{'device':6} {'dtype':8} {'bits':>4} {'copy ms':>8} {'quant ms':>9} {'deq ms':>8} "
    f"{'ref q ms':>9} {'ref dq ms':>9} {'copy GB/s':>9} {'q GB/s':>7} {'dq GB/s':>7} "
    f"{'rt/copy':>7} {'vs 4b':>6} {'vs ref':>7}"
)


def print_row(r: dict[str, object]) -> None:
    vs4 = "-" if r["round_trip_over_4_bits"] is None else f"{r['round_trip_over_4_bits']:.2f}"
    print(
        f"{r['device']:6} {r['dtype']:8} {r['bits']:>4} {r['copy_ms']:8.2f} "
        f"{r['quantize_ms']:9.2f} {r['dequantize_ms']:8.2f} {r['ref_quantize_ms']:9.1f} "
        f"{r['ref_dequantize_ms']:9.1f} {r['copy_GBps']:9.2f} {r['quantize_GBps']:7.2f} "
        f"{r['dequantize_GBps']:7.2f} {r['round_trip_over_copy']:7.2f} {vs4:>6} "
        f"{r['speedup_over_reference']:6.1f}x",
        flush=True,
    )


def int_cases(device: torch.device, scale: int) -> dict[str, torch.Tensor]:
    """Integer tensors a training step saves; ``scale`` divides the batch (for quick runs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(32 // scale, 64, 112, 112, device=device, generator=gen).relu_()
    _, pool = F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)
    _, pool_cl = F.max_pool2d(
        x.contiguous(memory_format=torch.channels_last), 3, 2, 1, return_indices=True
    )
    del x
    tokens = torch.randint(0, 50257, (32 // scale, 1024), device=device, generator=gen)
    return {"maxpool_nchw": pool, "maxpool_channels_last": pool_cl, "token_ids": tokens}


def bench_ints(name: str, x: torch.Tensor, repeats: int) -> dict[str, object]:
    p = gact_kernels.pack_ints(x)
    assert torch.equal(gact_kernels.unpack_ints(p), x)
    t = median_seconds(
        {
            "copy": x.clone,
            "pack": lambda: gact_kernels.pack_ints(x),
            "unpack": lambda: gact_kernels.unpack_ints(p),
        },
        x.device,
        repeats,
    )
    widths = p.widths.float()
    return {
        "device": x.device.type,
        "case": name,
        "shape": list(x.shape),
        "dtype": str(x.dtype).replace("torch.", ""),
        "raw_bytes": x.numel() * x.element_size(),
        "packed_bytes": p.nbytes,
        "ratio": x.numel() * x.element_size() / p.nbytes,
        "mean_width": widths.mean().item(),
        "max_width": int(widths.max().item()),
        "copy_ms": t["copy"] * 1e3,
        "pack_ms": t["pack"] * 1e3,
        "unpack_ms": t["unpack"] * 1e3,
        "pack_over_copy": t["pack"] / t["copy"],
        "unpack_over_copy": t["unpack"] / t["copy"],
    }


INT_HEADER = (
    f"{'device':6} {'case':22} {'MiB':>7} {'packed MiB':>10} {'ratio':>6} {'bits':>5} "
    f"{'copy ms':>8} {'pack ms':>8} {'unpack ms':>9} {'pack/copy':>9} {'unpack/copy':>11}"
)


def print_int_row(r: dict[str, object]) -> None:
    print(
        f"{r['device']:6} {r['case']:22} {r['raw_bytes'] / 2**20:7.1f} "
        f"{r['packed_bytes'] / 2**20:10.2f} {r['ratio']:6.2f} {r['mean_width']:5.1f} "
        f"{r['copy_ms']:8.2f} {r['pack_ms']:8.2f} {r['unpack_ms']:9.2f} "
        f"{r['pack_over_copy']:9.2f} {r['unpack_over_copy']:11.2f}",
        flush=True,
    )


def run_ints(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for device in _devices(args):
        for name, x in int_cases(device, args.int_batch_divisor).items():
            rows.append(bench_ints(name, x, args.repeats))
            print_int_row(rows[-1])
    return rows


def relu_like(numel: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Half zeros (at random positions), half |N(0, 1)|: a ReLU output."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(numel, device=device, generator=gen).abs_()
    return x.masked_fill_(torch.rand(numel, device=device, generator=gen) < 0.5, 0.0)


def round_trip_errors(
    x: torch.Tensor, bits: int, zero_exact: bool, seeds: int
) -> tuple[float, float]:
    """Mean squared error of the round trip over the positive elements (mean over ``seeds``
    seeds), and the share of positive elements restored as 0 (sign flips), in float64."""
    positive = x > 0
    xp = x[positive].double()
    mse = flips = 0.0
    for seed in range(seeds):
        q = gact_kernels.quantize(x, bits, seed=seed, zero_exact=zero_exact)
        yp = gact_kernels.dequantize(q)[positive].double()
        mse += (yp - xp).square().mean().item() / seeds
        flips += (yp == 0).double().mean().item() / seeds
    return mse, flips


def bench_zero_exact(x: torch.Tensor, bits: int, repeats: int, seeds: int) -> dict[str, object]:
    normal = gact_kernels.quantize(x, bits, seed=1)
    exact = gact_kernels.quantize(x, bits, seed=1, zero_exact=True)
    assert exact.nbytes == normal.nbytes
    times = interleaved_seconds(
        {
            "quantize": lambda: gact_kernels.quantize(x, bits, seed=1),
            "quantize_zx": lambda: gact_kernels.quantize(x, bits, seed=1, zero_exact=True),
            "dequantize": lambda: gact_kernels.dequantize(normal),
            "dequantize_zx": lambda: gact_kernels.dequantize(exact),
        },
        x.device,
        repeats,
    )
    mse_normal, flips_normal = round_trip_errors(x, bits, False, seeds)
    mse_exact, flips_exact = round_trip_errors(x, bits, True, seeds)
    if flips_exact != 0.0:
        raise AssertionError("zero_exact=True restored a positive element as 0")
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {
        "device": x.device.type,
        "dtype": str(x.dtype).replace("torch.", ""),
        "bits": bits,
        "numel": x.numel(),
        "quantize_ms": med["quantize"],
        "quantize_zx_ms": med["quantize_zx"],
        "dequantize_ms": med["dequantize"],
        "dequantize_zx_ms": med["dequantize_zx"],
        "quantize_ratio": median_ratio(times, "quantize_zx", "quantize"),
        "dequantize_ratio": median_ratio(times, "dequantize_zx", "dequantize"),
        "mse_normal": mse_normal,
        "mse_zero_exact": mse_exact,
        "mse_ratio": mse_exact / mse_normal,
        "mse_ratio_expected": ((2**bits - 1) / (2**bits - 2)) ** 2,
        "sign_flips_normal": flips_normal,
    }


ZX_HEADER = (
    f"{'device':6} {'dtype':8} {'bits':>4} {'quant ms':>8} {'zx':>7} {'ratio':>5} "
    f"{'deq ms':>8} {'zx':>7} {'ratio':>5} {'MSE normal':>10} {'MSE zx':>9} {'ratio':>5} "
    f"{'expect':>6} {'flips normal':>12}"
)


def print_zx_row(r: dict[str, object]) -> None:
    print(
        f"{r['device']:6} {r['dtype']:8} {r['bits']:>4} {r['quantize_ms']:8.2f} "
        f"{r['quantize_zx_ms']:7.2f} {r['quantize_ratio']:5.2f} {r['dequantize_ms']:8.2f} "
        f"{r['dequantize_zx_ms']:7.2f} {r['dequantize_ratio']:5.2f} {r['mse_normal']:10.3e} "
        f"{r['mse_zero_exact']:9.3e} {r['mse_ratio']:5.3f} {r['mse_ratio_expected']:6.3f} "
        f"{100 * r['sign_flips_normal']:11.3f}%",
        flush=True,
    )


def run_zero_exact(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for device in _devices(args):
        for name in args.dtypes:
            dtype = DTYPES[name]
            numel = args.size_mib * 2**20 // torch.empty((), dtype=dtype).element_size()
            x = relu_like(numel, device).to(dtype)
            for bits in args.zx_bits:
                rows.append(bench_zero_exact(x, bits, args.repeats, args.zx_seeds))
                print_zx_row(rows[-1])
            del x
    return rows


#: (batch, channels, height, width) of saved feature maps: ResNet-18 layout on 32x32 CIFAR-10 at
#: batch 64, and the MNIST example's memory configuration at batch 512.
FEATURE_MAPS = (
    (64, 64, 32, 32), (64, 128, 16, 16), (64, 256, 8, 8), (64, 512, 4, 4),
    (512, 16, 28, 28), (512, 32, 14, 14), (512, 64, 7, 7),
)  # fmt: skip


def bench_channels(x: torch.Tensor, bits: int, repeats: int) -> dict[str, object]:
    q = gact_kernels.quantize(x, bits, seed=1, channel_dim=1)
    flat = gact_kernels.quantize(x, bits, seed=1)
    ms = median_seconds(
        {
            "copy": x.clone,
            "quantize": lambda: gact_kernels.quantize(x, bits, seed=1, channel_dim=1),
            "dequantize": lambda: gact_kernels.dequantize(q),
            "quantize_flat": lambda: gact_kernels.quantize(x, bits, seed=1),
            "dequantize_flat": lambda: gact_kernels.dequantize(flat),
        },
        x.device,
        repeats,
    )
    cl = (
        x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
    )
    return {
        "device": x.device.type,
        "dtype": str(x.dtype).replace("torch.", ""),
        "bits": bits,
        "shape": list(x.shape),
        "layout": "channels_last" if cl else "nchw",
        "grouping": "channel runs" if q.channel_dim is not None else f"planes of {q.group_size}",
        **{f"{name}_ms": 1e3 * t for name, t in ms.items()},
    }


def run_channels(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for device in _devices(args):
        for name in args.dtypes:
            for shape in FEATURE_MAPS:
                x = torch.randn(shape, device=device).to(DTYPES[name])
                for layout in (torch.contiguous_format, torch.channels_last):
                    rows.append(bench_channels(x.contiguous(memory_format=layout), 4, args.repeats))
                    print_channel_row(rows[-1])
    return rows


CHANNEL_HEADER = (
    f"{'device':6} {'dtype':8} {'shape':>16} {'layout':13} {'grouping':15} {'copy ms':>8} "
    f"{'quant ms':>9} {'deq ms':>8} {'flat q ms':>9} {'flat dq ms':>10}"
)


def print_channel_row(r: dict[str, object]) -> None:
    shape = "x".join(str(d) for d in r["shape"])  # type: ignore[union-attr]
    print(
        f"{r['device']:6} {r['dtype']:8} {shape:>16} {r['layout']:13} {r['grouping']:15} "
        f"{r['copy_ms']:8.2f} {r['quantize_ms']:9.2f} {r['dequantize_ms']:8.2f} "
        f"{r['quantize_flat_ms']:9.2f} {r['dequantize_flat_ms']:10.2f}",
        flush=True,
    )


def summarise(rows: list[dict[str, object]]) -> None:
    for device in sorted({r["device"] for r in rows}):
        mine = [r for r in rows if r["device"] == device]
        if device == "cpu":
            for dtype, limit in (("float32", 1.3), ("float16", 2.0), ("bfloat16", 2.0)):
                at = [r for r in mine if r["dtype"] == dtype]
                if not at:
                    continue
                worst = max(r["round_trip_over_copy"] for r in at)
                widths = [  # 8 bits stores twice 4 bits' codes and packs none
                    r["round_trip_over_4_bits"]
                    for r in at
                    if r["round_trip_over_4_bits"] and r["bits"] < 8
                ]
                line = (
                    f"cpu {dtype}: round trip <= {limit}x copy (worst {worst:.2f}x: "
                    f"{'met' if worst <= limit else 'NOT met'})"
                )
                if widths:  # 4 bits and another width below 8 were timed
                    line += (
                        f"; widths 1-7 within 10% of 4 bits ({min(widths):.2f}-"
                        f"{max(widths):.2f}x: {'met' if max(widths) <= 1.1 else 'NOT met'})"
                    )
                print(line)
            worst_ref = min(r["speedup_over_reference"] for r in mine)
            print(
                f"cpu: >= 10x faster than the reference (worst {worst_ref:.1f}x: "
                f"{'met' if worst_ref >= 10 else 'NOT met'})"
            )
        else:
            worst = min(r["bandwidth_fraction"] for r in mine)
            print(
                f"{device} target: >= 70% of copy bandwidth (worst {100 * worst:.0f}%: "
                f"{'met' if worst >= 0.7 else 'NOT met'})"
            )


def run_paths(args: argparse.Namespace) -> list[dict[str, object]]:
    """Round trips on both packing paths per dtype and width, over the portable 4-bit one."""
    from gact_kernels import _cpu

    if not _cpu.vbmi_supported():
        print("this CPU has no AVX-512 VBMI: one packing path only")
        return []
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        numel = args.size_mib * 2**20 // torch.empty((), dtype=dtype).element_size()
        x = torch.randn(numel).to(dtype)
        calls = {}
        for path in ("portable", "vbmi"):
            for bits in args.bits:
                q = gact_kernels.quantize(x, bits, seed=1)

                def round_trip(
                    path: str = path,
                    bits: int = bits,
                    x: torch.Tensor = x,
                    q: gact_kernels.QuantizedTensor = q,
                ) -> None:
                    before = _cpu.use_vbmi(path == "vbmi")
                    gact_kernels.quantize(x, bits, seed=1)
                    gact_kernels.dequantize(q)
                    _cpu.use_vbmi(before)

                calls[path, bits] = round_trip
        times = interleaved_seconds(calls, torch.device("cpu"), args.repeats)
        for bits in args.bits:
            row = {"dtype": name, "bits": bits}
            for path in ("portable", "vbmi"):
                row[f"{path}_ms"] = 1e3 * statistics.median(times[path, bits])
                row[f"{path}_over_4_bits"] = median_ratio(times, (path, bits), ("portable", 4))
            rows.append(row)
            print(
                f"{name:8} {bits:>4} {row['portable_ms']:11.2f} {row['vbmi_ms']:8.2f} "
                f"{row['portable_over_4_bits']:14.2f} {row['vbmi_over_4_bits']:10.2f}",
                flush=True,
            )
    return rows


PATHS_HEADER = (
    f"{'dtype':8} {'bits':>4} {'portable ms':>11} {'vbmi ms':>8} {'portable / 4b':>14} "
    f"{'vbmi / 4b':>10}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--size-mib", type=int, default=64, help="input size (default 64)")
    parser.add_argument("--bits", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per kernel")
    parser.add_argument("--ref-repeats", type=int, default=3, help="timed runs of the reference")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's default)")
    parser.add_argument(
        "--int-batch-divisor", type=int, default=1, help="shrink the integer cases' batch"
    )
    parser.add_argument(
        "--zx-bits", type=int, nargs="+", default=[2, 3, 4, 8], help="zero-exact widths"
    )
    parser.add_argument(
        "--zx-seeds", type=int, default=3, help="seeds averaged in the zero-exact MSE"
    )
    parser.add_argument(
        "--only",
        choices=["quantize", "paths", "ints", "zero_exact", "channels"],
        help="run one part only",
    )
    parser.add_argument(
        "--devices", nargs="+", choices=["cpu", "cuda"], default=["cpu", "cuda"],
        help="devices to time (default both; cuda where available)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    rows, path_rows, int_rows, zx_rows, channel_rows = [], [], [], [], []
    if args.only in (None, "quantize"):
        print(HEADER)
        rows = run(args)
        summarise(rows)
    if args.only in (None, "paths"):
        print(PATHS_HEADER)
        path_rows = run_paths(args)
    if args.only in (None, "ints"):
        print(INT_HEADER)
        int_rows = run_ints(args)
    if args.only in (None, "zero_exact"):
        print(ZX_HEADER)
        zx_rows = run_zero_exact(args)
    if args.only in (None, "channels"):
        print(CHANNEL_HEADER)
        channel_rows = run_channels(args)
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), **vars(args)}
        with open(args.json, "w") as f:
            json.dump(
                {
                    "meta": meta,
                    "rows": rows,
                    "path_rows": path_rows,
                    "int_rows": int_rows,
                    "zero_exact_rows": zx_rows,
                    "channel_rows": channel_rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
