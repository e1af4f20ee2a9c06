"""The bar above all, as the tests hold runs to it: the unsplit pp=1 run (``reference``, in the
test process, by the same training loop) and the comparison of a pipelined case with it."""

from __future__ import annotations

from pathlib import Path

import torch

from runner.ranks.dist import DistEnv
from runner.train import train
from runner.validate import validate
from runner.verify.compare import TOLERANCES

from helpers.config import TINY, compose
from helpers.ranks import FirstGrads

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
# Clipping must bind, or a per-rank clip would pass: gradient norms here are ~1.
CLIP = ["train.grad_clip=0.05"]
LOSS_RTOL = 1e-4
GRAD_RTOL, GRAD_ATOL = 1e-5, 4e-5


def reference(tmp_path: Path, *overrides: str) -> dict:
    """The unsplit run (``TINY``, ``CLIP``, pp=1) in ``tmp_path/reference``: its losses, the first
    step's gradients before and after clipping, and its summary."""
    cfg = compose(*TINY, *CLIP, "parallel.pp=1", *overrides)
    run_dir = tmp_path / "reference"
    run_dir.mkdir()
    grads = FirstGrads()
    result = train(validate(cfg, run_dir), cfg, DistEnv(0, 1, torch.device("cpu")), hooks=[grads])
    return {"losses": result.losses, "grads": grads.grads, "clipped": grads.clipped,
            "summary": result.summary}


def first_steps(got: dict, steps: int) -> dict:
    """A longer run's record held to a ``steps``-step reference: its first ``steps`` losses (the
    first step's gradients are the same in both). Valid where the learning rates of the updates
    before them do not depend on the run's length (warmup; test_parity checks it of the defaults)."""
    assert "error" not in got, got.get("traceback")
    assert len(got["losses"]) > steps, len(got["losses"])
    return {**got, "losses": got["losses"][:steps]}


def assert_matches(got: dict, ref: dict, case: str, steps: int = 5) -> None:
    """``steps`` losses and the first step's gradients, before and after the global clip, by name."""
    assert "error" not in got, f"{case}: {got.get('traceback')}"
    assert len(got["losses"]) == len(ref["losses"]) == steps
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{case} losses: {m}")
    for kind in ("grads", "clipped"):  # after the first backward, and after the global clip
        assert got[kind].keys() == ref[kind].keys(), case
        for name, ref_grad in ref[kind].items():
            assert ref_grad is not None and got[kind][name] is not None, f"{case}: {name} has no grad"
            torch.testing.assert_close(got[kind][name], ref_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       msg=lambda m, kind=kind, name=name: f"{case} {kind} {name}: {m}")


def assert_close_at_bf16(got: dict, ref: dict, case: str) -> None:
    """A bf16 run against the bf16 reference: losses to 1e-2, gradients to verify's bf16 tolerances
    and still fp32 (the parameters are)."""
    rtol, atol = TOLERANCES["bf16"]
    assert "error" not in got, f"{case}: {got.get('traceback')}"
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0)
    for name, ref_grad in ref["grads"].items():
        grad = got["grads"][name]
        assert grad.dtype == torch.float32, f"{case} {name}: gradients (and so parameters) must stay fp32"
        torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{case} {n}: {m}")
