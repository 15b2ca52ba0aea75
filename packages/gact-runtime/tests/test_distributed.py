"""DDP: probes all-reduce like any step, and every rank ends with the same bits."""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WORLD = 2


def _init(rank: int, store: str) -> None:
    """Rendezvous through a file (a free TCP port can be taken by another process between its
    discovery and the workers' bind: that made these tests flaky on busy machines)."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),  # a rank that failed ends the barrier too
    )


def _close(code: int) -> None:
    """Leave the group together, then end the process at once with ``code``.

    A rank that tears gloo down while the other is still in a collective aborts, and so, now and
    then, does a rank whose interpreter shutdown destroys a C++ thread gloo or DDP still holds
    ("terminate called without an active exception": SIGABRT after the test's work was done, on
    a busy machine). The results are in the queue before this runs, and ``os._exit`` skips that
    shutdown; a failure exits non-zero, which ``start_processes`` reports.
    """
    try:
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _worker(rank: int, store: str, queue: mp.SimpleQueue, bucket_view: bool) -> None:
    from gact import Controller, GactConfig

    _init(rank, store)
    code = 1
    try:
        torch.manual_seed(0)  # same initial weights on every rank
        model = DistributedDataParallel(
            nn.Sequential(
                nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
            ),
            gradient_as_bucket_view=bucket_view,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)  # different data on every rank
        # rank 1's batch is smaller: its sites are fewer-element than rank 0's, and its
        # last layer's input falls below min_numel, yet both ranks must probe the same items
        n = 64 if rank == 0 else 48
        x, y = torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
        cfg = GactConfig.from_level("L2", min_numel=6144, adapt_interval=2)

        def closure() -> None:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()

        # The real step's gradients, without probes (a fresh controller uses the same seeds).
        with Controller(model, cfg) as reference:
            reference.run_closure(closure)
        expected = [p.grad.clone() for p in model.parameters()]
        with Controller(model, cfg) as controller:
            for step in range(4):
                controller.iterate(closure)  # adapts at steps 0 and 2
                if step == 0:
                    grads_kept = all(
                        torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected)
                    )
                optimizer.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()  # small: the pipe is joined
        queue.put((rank, dict(controller.plan.bits), digest, grads_kept))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        _close(code)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_ranks_agree_on_bits_and_weights(bucket_view: bool, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "store"), queue, bucket_view),
        nprocs=WORLD,
        start_method="spawn",
    )
    results = sorted(queue.get() for _ in range(WORLD))
    (_, bits0, params0, kept0), (_, bits1, params1, kept1) = results
    assert bits0 and bits0 == bits1
    assert params0 == params1  # the replicas stayed identical through probes and steps
    assert kept0 and kept1  # probes did not overwrite the real step's (bucket-view) gradients


def _fsdp_worker(rank: int, store: str, queue: mp.SimpleQueue) -> None:
    from gact import Controller, GactConfig
    from gact.ledger import Kind
    from torch.distributed.fsdp import fully_shard

    _init(rank, store)
    code = 1
    try:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)

        def closure() -> None:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()

        cfg = GactConfig.from_level("L2", min_numel=0, adapt_interval=2)
        with Controller(model, cfg) as controller:
            for _ in range(4):
                controller.iterate(closure)  # adapts at steps 0 and 2
                optimizer.step()
        full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
        records = controller.ledger.last.values()
        parameter_shapes = {(10, 128), (128, 128), (128, 64), (128,), (10,)}
        quantized_shapes = {r.shape for r in records if r.kind is Kind.QUANTIZED}
        queue.put(
            (
                rank,
                dict(controller.plan.bits),
                hashlib.sha256(full.numpy().tobytes()).hexdigest(),
                controller.stats()["parameter_saves"] > 0,
                not quantized_shapes & parameter_shapes,
            )
        )
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        _close(code)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp_ranks_agree_on_bits_and_weights(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _fsdp_worker, args=(str(tmp_path / "store"), queue), nprocs=WORLD, start_method="spawn"
    )
    results = sorted(queue.get() for _ in range(WORLD))
    (_, bits0, params0, saw0, clean0), (_, bits1, params1, saw1, clean1) = results
    assert bits0 and bits0 == bits1  # same sketch sums, same estimates, same widths
    assert params0 == params1
    assert saw0 and saw1 and clean0 and clean1  # unsharded parameters seen, never quantized
