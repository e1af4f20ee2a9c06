"""The overhead baseline: the smallest hand-written pipeline loop over the runner's own model,
split and data on 2 spawned ranks (``Schedule1F1B.step()`` and AdamW, nothing else), writing
each step's seconds as a JSON list.

    python bare_loop.py <resolved config as JSON> <store file> <out file>
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from runner.data.datasets import SyntheticData
from runner.losses import cross_entropy
from runner.models.split import build_meta_model, materialize, plan_split


def rank(r: int, cfg: dict, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg)
    cuda = cfg.device == "cuda"  # as the runner: NCCL, one GPU per rank
    device = torch.device("cuda", r) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, 2), rank=r, world_size=2,
                            device_id=device if cuda else None)
    t, m = cfg.train, cfg.parallel.microbatches
    meta = build_meta_model(cfg.model)
    module = materialize(meta, plan_split(meta, 2, None)[r], seed=t.seed, device=device)
    schedule = Schedule1F1B(PipelineStage(module, r, 2, device), m, loss_fn=cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=t.lr)
    data = SyntheticData(vocab_size=cfg.data.vocab_size, signal=cfg.data.signal, seed=t.seed)
    times = []
    for step in range(t.steps):
        x, y = (b.to(device) for b in data.batch(step + 1, t.batch_size, t.seq_len))  # steps from 1
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if r == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if r == 0:
        with open(out, "w") as f:
            f.write(json.dumps(times))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank, args=(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]), nprocs=2)
