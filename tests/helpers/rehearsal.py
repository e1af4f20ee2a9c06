"""What a real run's ranks hold, for the rehearsal's comparison (``runner.rehearse.memory``), and
their peak measured as a rehearsal measures it (torch's ``MemTracker``, ``peak_tracker``)."""

from __future__ import annotations

from typing import Any

from runner._torch.rehearsal import peak_split, peak_tracker
from runner.hooks import Hook, StepContext, StepState
from runner.ranks.dist import gather_to_main
from runner.rehearse.memory import held_bytes

# The cases whose ranks' peaks are tracked (the tracker's dispatch mode slows every op: only the
# case a rehearsal is compared with), by run directory name.
TRACKED_CASES = frozenset({"llama-1f1b", "builtin-pp4-dp2-fsdp"})


class HeldBytes(Hook):
    """Every rank's parameter, gradient and optimizer-state bytes after the last step, on rank 0
    (the summary's ``held_bytes``, by rank); in ``TRACKED_CASES`` also each rank's peak over the
    step before the last (``tracked_peak_bytes``, by rank): a steady step, after verify's reference steps,
    with the optimizer state made."""

    def __init__(self) -> None:
        self.by_rank: list | None = None
        self.peaks: list | None = None
        self._tracker: Any = None

    def _tracked(self, ctx: StepContext, state: StepState) -> bool:
        run_dir = ctx.resolved.run_dir
        return run_dir is not None and run_dir.name in TRACKED_CASES and state.step == ctx.resolved.steps - 1

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        if self._tracked(ctx, state):
            self._tracker = peak_tracker(ctx.modules, ctx.optimizer)
            self._tracker.__enter__()

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if self._tracker is not None and self._tracked(ctx, state):
            self._tracker.__exit__(None, None, None)
            peaks, self._tracker = peak_split(self._tracker, ctx.env.device), None  # it holds the modules: let them go
            self.peaks = gather_to_main(peaks, ctx.env)
        if state.step == ctx.resolved.steps:
            self.by_rank = gather_to_main(held_bytes(ctx.params, ctx.optimizer), ctx.env)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"held_bytes": self.by_rank} if self.by_rank is not None else {}
        if self.peaks is not None:
            out["tracked_peak_bytes"] = self.peaks
        return out


def held_bytes_hooks() -> list[Hook]:
    return [HeldBytes()]


def _vm_bytes(field: str) -> int:
    """This process's ``VmSize`` or ``VmPeak``: its address space, what ``RLIMIT_AS`` counts."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) * 1024


def _map_large_allocations() -> None:
    """glibc maps every allocation of 64 KiB or more on its own (and unmaps it when freed) and
    keeps one arena: the address space then follows the tensors alive, not glibc's reuse policy
    (by default freed chunks under 32 MiB may stay reserved)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-8, 1)  # M_ARENA_MAX


def _load_what_a_first_step_loads() -> None:
    """One backward and one AdamW step of a tiny tensor: what a process's first ones map once
    (modules imported lazily, their libraries: about 75 MB of address space with the CPU wheel, 214 MB
    with torch 2.11's CUDA wheel) is mapped before the baseline, so the budget holds the rank's
    tensors and not the size of the torch build."""
    import torch

    weight = torch.ones(4, requires_grad=True)
    (weight * 2).sum().backward()
    torch.optim.AdamW([weight]).step()


def rehearse_under_a_memory_limit(cfg_dict: dict, rank: int, budget: int | None, out: str) -> None:
    """A forked process's target: rehearse ``rank`` of the run for one step (its memory pass: AdamW's
    state made, one tracked step) with this process's
    address space limited to what it holds now plus ``budget`` bytes (``RLIMIT_AS``; None:
    unlimited, to calibrate), then build the whole model with its AdamW state under the same
    limit. Writes what happened (JSON) to ``out``."""
    import json
    import resource
    from pathlib import Path

    import torch
    from omegaconf import OmegaConf

    import runner.train  # noqa: F401  (what the rank imports, before the baseline)
    from runner.models.split import build_meta_model, materialize
    from runner.rehearse.launch import check_rehearsal
    from runner.rehearse.rank import RankPass, run_rank

    torch.set_num_threads(1)  # no thread pool to start under the limit
    _map_large_allocations()
    cfg = OmegaConf.create(cfg_dict)
    run_dir = Path(out).parent / "run"
    resolved = check_rehearsal(cfg, run_dir).resolved
    _load_what_a_first_step_loads()
    baseline = _vm_bytes("VmSize")
    if budget is not None:
        resource.setrlimit(resource.RLIMIT_AS, (baseline + budget, resource.getrlimit(resource.RLIMIT_AS)[1]))
    report: dict[str, Any] = {"baseline": baseline, "budget": budget}
    result = run_rank(resolved, cfg, rank, RankPass(tracked=1, timed=False, profiled=False), run_dir / f"rank{rank}")
    report.update(held_bytes=result["held_bytes"], losses=result["losses"], rank_peak=_vm_bytes("VmPeak") - baseline)
    del result
    try:
        meta = build_meta_model(cfg.model)
        whole = materialize(meta, meta.unit_names, seed=0, device=torch.device("cpu"))
        optimizer = torch.optim.AdamW(whole.parameters())
        for p in whole.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        report["whole"] = "fits"
    except (MemoryError, RuntimeError) as e:
        report["whole"] = f"{type(e).__name__}: {str(e)[:300]}"
    report["peak"] = _vm_bytes("VmPeak") - baseline
    Path(out).write_text(json.dumps(report))
