"""The startup baseline: spawn 2 ranks that import torch and bring up a process group, and write
the seconds from ``start`` (the launcher's clock before this process started) to the group's
first barrier.

    python bare_spawn.py <store file> <start: time.time()> <out file> <cpu|cuda>
"""

import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r: int, store: str, start: float, out: str, cuda: bool) -> None:
    if cuda:  # as the runner: NCCL, one GPU per rank
        torch.cuda.set_device(r)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, 2), rank=r, world_size=2,
                            device_id=torch.device("cuda", r) if cuda else None)
    dist.barrier()
    if r == 0:
        with open(out, "w") as f:
            f.write(str(time.time() - start))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4] == "cuda"), nprocs=2)
