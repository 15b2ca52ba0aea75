"""Train a small GPT-2 on tiny-shakespeare with Hugging Face ``Trainer``; GACT is one callback.

    python examples/hf/train_trainer.py --data DATA --level L0 --out l0.json   # fp32 (measured)
    python examples/hf/train_trainer.py --data DATA --level L2 --out l2.json

DATA is the folder holding ``tinyshakespeare/input.txt``, or ``tinyshakespeare/`` itself. The
model is built from a ``GPT2Config`` with random weights and a byte-level vocabulary (the 256
byte values; nothing is downloaded). The JSON record has the final evaluation loss (on held-out
blocks from the last 10% of the text), the saved-activation ratio of the last training step
(``controller.stats()``) and the peak memory of ``trainer.train()`` over what was in use before
(CUDA: ``max_memory_allocated``; CPU: peak resident size). Level L0 runs the same hooks without
compressing anything, so it is the fp32 baseline with its saved bytes measured. Needs
``pip install "./packages/gact-runtime[transformers]" ./examples``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from gact import LEVELS, GactConfig
from gact.integrations import DEFAULT_PROBE_SHARE
from gact.integrations.transformers import GactCallback
from gact_examples.memory import MemoryMeter, tune_malloc_for_measurement
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class ByteBlocks(torch.utils.data.Dataset):
    """Consecutive non-overlapping blocks of ``block_size`` bytes; labels are the inputs (the
    model shifts them)."""

    def __init__(self, data: torch.Tensor, block_size: int, limit: int | None = None) -> None:
        count = len(data) // block_size
        self.blocks = data[: count * block_size].view(count, block_size)[:limit]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="folder holding tinyshakespeare/")
    p.add_argument("--level", default="L2", choices=list(LEVELS))
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--adapt-interval", type=int, default=100, help="steps between adaptations")
    p.add_argument(
        "--probe-batch-size",
        type=int,
        default=None,
        help="sensitivity probes replay only this many rows of the micro-batch (default: "
        "GactCallback's, a quarter of it; the tensors read linearly need no probe)",
    )
    p.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks to evaluate on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    p.add_argument(
        "--tune-malloc",
        action="store_true",
        help="make glibc return freed memory (process-wide), so that the CPU peak follows live "
        "memory; by default the peak is the process's under the malloc users run",
    )
    p.add_argument("--out", type=Path, default=Path("train_trainer.json"), help="JSON record")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "eval_blocks", "adapt_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def load_bytes(data: Path) -> torch.Tensor:
    """The text's UTF-8 bytes as int64 token ids."""
    for path in (data / "input.txt", data / "tinyshakespeare" / "input.txt"):
        if path.is_file():
            return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    raise FileNotFoundError(f"no input.txt in {data} or {data / 'tinyshakespeare'}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tuned = args.tune_malloc and tune_malloc_for_measurement()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokens = load_bytes(args.data)
    split = int(len(tokens) * 0.9)
    train_set = ByteBlocks(tokens[:split], args.block_size)
    eval_set = ByteBlocks(tokens[split:], args.block_size, limit=args.eval_blocks)
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.block_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    callback = GactCallback(
        GactConfig.from_level(args.level, adapt_interval=args.adapt_interval),
        probe_batch_size=args.probe_batch_size or DEFAULT_PROBE_SHARE,
    )
    training = TrainingArguments(
        output_dir=str(args.out.parent / f"{args.out.stem}-trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=min(20, args.steps // 10),
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=not sys.stderr.isatty(),
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=train_set,
        eval_dataset=eval_set,
        callbacks=[callback],
    )
    meter = MemoryMeter(training.device)
    meter.start()
    output = trainer.train()
    meter.stop()
    stats = callback.controller.stats()  # the last training step; evaluation saves nothing
    record = {
        "level": args.level,
        "steps": args.steps,
        "eval_loss": trainer.evaluate()["eval_loss"],
        "train_loss": output.training_loss,
        "saved_activation_ratio": stats["ratio"],
        "saved_bytes_per_step": stats["original_bytes"],
        "stored_bytes_per_step": stats["stored_bytes"],
        "peak_memory_bytes": meter.delta,
        "peak_memory_method": meter.method + (" + glibc mmap threshold 128 KiB" if tuned else ""),
        "train_seconds": output.metrics["train_runtime"],
        "adaptations": stats["adaptations"],
        "adaptation_overhead": stats["adaptation_overhead"],
        "device": str(training.device),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "args"}, indent=2))
    return record


if __name__ == "__main__":
    main()
