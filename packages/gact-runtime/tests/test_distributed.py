"""DDP: probes all-reduce like any step, and every rank ends with the same bits."""

from __future__ import annotations

import hashlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, queue: mp.SimpleQueue) -> None:
    from gact import Controller, GactConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # same initial weights on every rank
        model = DistributedDataParallel(
            nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))  # fmt: skip
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)  # different data on every rank
        x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
        cfg = GactConfig.from_level("L2", min_numel=0, adapt_interval=2)
        with Controller(model, cfg) as controller:
            for _ in range(4):

                def closure() -> None:
                    loss = F.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()

                controller.iterate(closure)
                optimizer.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()  # small: the pipe is joined
        queue.put((rank, dict(controller.plan.bits), digest))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_ranks_agree_on_bits_and_weights() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(_free_port(), queue), nprocs=WORLD, start_method="spawn")
    results = sorted(queue.get() for _ in range(WORLD))
    (_, bits0, params0), (_, bits1, params1) = results
    assert bits0 and bits0 == bits1
    assert params0 == params1  # the replicas stayed identical through probes and steps
