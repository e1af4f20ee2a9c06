"""The one-device baseline: a hand-written training loop over a finished run's model and data
(pp=1, no pipeline schedule, no runner): forward, cross-entropy, backward, the global-norm clip
and AdamW, each step timed to a device synchronize. Writes each step's seconds as a JSON list.
The GPU checks (``scripts/gpu_checks.sh``) set the runner's step beside it.

    python single_loop.py <run dir> <out file> [steps]
"""

import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from runner.data.datasets import SyntheticData
from runner.losses import cross_entropy
from runner.models.split import build_meta_model, materialize


def main(run: Path, out: Path, steps: int) -> None:
    cfg = OmegaConf.load(run / "resolved_config.yaml")
    t = cfg.train
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    meta = build_meta_model(cfg.model)
    model = materialize(meta, meta.unit_names, seed=t.seed, device=device)
    if t.precision == "bf16":  # as the runner: autocast the forward, fp32 weights and optimizer state
        model.autocast_dtype = torch.bfloat16
    step_fn = torch.compile(model) if t.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.betas[0], t.betas[1]))
    data = SyntheticData(vocab_size=cfg.data.vocab_size, signal=cfg.data.signal, seed=t.seed)
    times = []
    for step in range(steps):
        x, y = (b.to(device) for b in data.batch(step + 1, t.batch_size, t.seq_len))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(step_fn(x), y)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        loss.item()  # the runner reads each step's loss
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out.write_text(json.dumps(times))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 8)
