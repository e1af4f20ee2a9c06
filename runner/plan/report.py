"""What ``python -m runner.plan`` prints: the ranked table of candidates and the search's report."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, Sequence, TypeVar

from runner.pipeline.schedule import V_SHAPED
from runner.plan.planner import Candidate
from runner.plan.probe import Fit

__all__ = ["label", "table", "candidate_table", "mark", "search_report", "rehearsal_report", "fit_line",
           "commit_line", "MEASURED_ERRORS", "MEASURED_ERROR", "within_error"]

# The planner's error on single plans (over every round and configuration of all model sizes), per
# subset: the configurations it did not probe, those it probed (fitted its cost model to a run of)
# and all of them; each its median and 90th percentile of |predicted / measured - 1|, as
# scripts/planner_accuracy.py computes them from benchmarks/planner.json (BENCHMARKS.md, "Planner
# accuracy per single plan"; a test holds them to that file).
MEASURED_ERRORS = {"not probed": (0.082, 0.307), "probed": (0.106, 0.206), "all": (0.086, 0.273)}
# The figure the planner marks candidates with: the not-probed one, since a plan's candidates are
# mostly configurations it did not probe.
MEASURED_ERROR = MEASURED_ERRORS["not probed"]


def _placement(c: Candidate) -> str:
    return "V" if c.schedule in V_SHAPED or (c.search or {}).get("placement") == "V" else "loop"


def _name(c: Candidate) -> str:
    return f"synthesized {_placement(c)}" if c.schedule == "synthesized" else c.schedule


def _degrees(c: Candidate) -> str:
    return "".join(f" {k}={v}" for k, v in c.degrees.items()) if c.degrees else ""  # not the run's own


def label(c: Candidate) -> str:
    split = f" split at {','.join(c.split_points)}" if c.split_points else ""
    return f"{_name(c)} m={c.microbatches} v={c.stages_per_rank}{split}{_degrees(c)}"


def fit_line(model: Fit) -> str:
    """The cost model as fitted, and how close it puts the probes' own steps."""
    off = [p["fitted_step_s"] / p["measured_step_s"] - 1 for p in model.probes]
    steady = all(p.get("step") == "bubble.steady" for p in model.probes)  # deferred runs (plan.barrier=false)
    steps = ("steady steps without the barrier (train.optimizer_sync=deferred, summary.json bubble.steady)"
             if steady else "steps")
    return (f"fitted to {len(model.probes)} run(s) ({', '.join(p['label'] for p in model.probes)}): forwards "
            f"x{model.forward_scale:.2f} and backwards x{model.backward_scale:.2f} their timings here, "
            f"{model.gap_s * 1e6:+.0f} us per action, {'updates' if steady else 'rest of step'} "
            f"x{model.rest_scale:.2f}; their {steps} predicted {min(off):+.1%} to {max(off):+.1%}")


def commit_line(name: str, steady_s: float, commit_s: float | None, amortized_s: float | None, committed: int,
                steps: int) -> str | None:
    """``plan.barrier=false``: the steps ``train.optimizer_sync=deferred`` validates at their own end
    (``runner.plan.planner.committed_steps``), what one costs (it does not overlap the next) and the
    step averaged over the run; None where there is no such figure (with the barrier)."""
    if commit_s is None or amortized_s is None:
        return None
    return (f"commit steps: the last step and those evaluated, saved or compared by verify ({committed} of "
            f"train.steps={steps}) are validated at their own end and do not overlap the next: {name} takes "
            f"{commit_s * 1e3:.2f} ms there against {steady_s * 1e3:.2f} ms steady, {amortized_s * 1e3:.2f} ms per "
            f"step over the run (plan.json: commit_step_s, amortized_step_s; the evaluations and saves themselves "
            f"not counted, nor a step whose norm needed clipping, which reruns the next step's forward and backward)")


def table(candidates: list[Candidate]) -> str:
    """One row per valid candidate; ``*`` marks the recommended one and ``=`` those tied with it.
    *vs bound*: how much longer the simulated pipeline is than the lower bound for its layout;
    *peak act*: the most activations a rank holds, per action (an I keeps the weight gradient's
    share), in microbatches' activations and in MiB ("-" where no bytes are known); *rank mem*: the
    whole-rank estimate of the fullest rank (``runner.plan.memory``; "-" where it is not known: a
    costs file holds no parameters)."""
    def row(c: Candidate) -> str:
        p = c.prediction()
        held = max(c.peak_activation_mb) if c.peak_activation_mb else max(c.peak_activations)
        nbytes, rank = max(c.peak_activation_bytes), max(c.rank_memory_bytes or [0])
        return (f"{mark(c)} {_name(c):<16} {c.microbatches:>2} {c.stages_per_rank:>2}  "
                f"{p.step_s * 1e3:9.2f}  {c.bubble:6.3f}  "
                f"{max(0.0, p.pipeline_s / p.lower_bound_s - 1):+8.1%}  {held:13.4g}  "
                f"{f'{nbytes / 2**20:14.2f}' if nbytes else '-':>14}  "
                f"{f'{rank / 2**20:14.1f}' if rank else '-':>14}  {'/'.join(map(str, c.stage_sizes))}{_degrees(c)}"
                f"{'' if c.fits_memory else '  over limit'}")

    return candidate_table("  schedule          m  v  step (ms)  bubble  vs bound  peak act (mb)  peak act (MiB)  "
                           "rank mem (MiB)  children per stage", candidates, row)


class Ranked(Protocol):
    """A candidate as a table ranks it (the planner's ``Candidate``, ``plan.target``'s)."""

    @property
    def valid(self) -> bool: ...

    @property
    def recommended(self) -> bool: ...

    @property
    def tie(self) -> bool: ...


R = TypeVar("R", bound=Ranked)


def mark(c: Ranked) -> str:
    """A row's first column: ``*`` the recommended candidate, ``=`` one tied with it."""
    return "*" if c.recommended else "=" if c.tie else " "


def candidate_table(header: str, candidates: Sequence[R], row: Callable[[R], str]) -> str:
    """``header``, a ``row`` per valid candidate, then how many are invalid (their reasons: plan.json)."""
    invalid = sum(not c.valid for c in candidates)
    rows = [header, *(row(c).rstrip() for c in candidates if c.valid)]
    if invalid:
        rows.append(f"({invalid} invalid candidates; their reasons are in plan.json)")
    return "\n".join(rows)


def search_report(candidates: list[Candidate]) -> list[str]:
    """How long the search took, and the fastest synthesized order against its lower bound and
    against the best built-in schedule on the same layout (microbatches, placement, split)."""
    searched = [c for c in candidates if c.schedule == "synthesized"]
    if not searched:
        return []
    seconds = sum(c.search["seconds"] for c in searched if c.search)
    evaluated = sum(c.search["evaluated"] for c in searched if c.search)
    lines = [f"search: {len(searched)} layouts, {evaluated} orders simulated in {seconds:.1f} s"]
    best = next((c for c in candidates if c.valid and c.fits_memory and c.schedule == "synthesized"), None)
    if best is not None:
        same = [c for c in candidates if c.valid and c.fits_memory and c.schedule != "synthesized"
                and c.microbatches == best.microbatches
                and c.stages_per_rank == best.stages_per_rank and c.split_points == best.split_points
                and _placement(c) == _placement(best)]
        p = best.prediction()
        line = (f"fastest synthesized ({label(best)}): pipeline {p.pipeline_s * 1e3:.2f} ms, lower bound "
                f"{p.lower_bound_s * 1e3:.2f} ms ({p.pipeline_s / p.lower_bound_s - 1:+.1%})")
        if same:
            builtin = min(same, key=lambda c: c.prediction().pipeline_s)
            b = builtin.prediction()
            line += (f"; best built-in there, {builtin.schedule}: {b.pipeline_s * 1e3:.2f} ms "
                     f"({b.pipeline_s / b.lower_bound_s - 1:+.1%})")
        assert best.search is not None  # a synthesized candidate is searched before it is predicted
        lines.append(line + f"; from {best.search['origin']}")
    return lines


def within_error(candidates: Sequence[Candidate], error: float = MEASURED_ERROR[0]) -> list[str]:
    """Mark (``within_error``) the candidates that fit and are predicted within ``error`` of the
    fastest of them; the message saying so, or nothing where only the fastest is."""
    fitting = [c for c in candidates if c.valid and c.fits_memory]
    if not fitting:
        return []
    fastest = fitting[0].prediction().step_s
    close = [c for c in fitting if c.prediction().step_s <= fastest * (1 + error)]
    for c in close:
        c.within_error = len(close) > 1
    if len(close) < 2:
        return []
    figures = "; ".join(f"{name}: median {median:.1%}, 90th percentile {p90:.1%}"
                        for name, (median, p90) in MEASURED_ERRORS.items())
    return [f"within error: {len(close)} candidates are predicted within {error:.1%} of the fastest, the planner's "
            f"median error on a single plan of a configuration it did not probe ({figures}; BENCHMARKS.md, "
            f"\"Planner accuracy per single plan\"): {', '.join(label(c) for c in close)}. A prediction cannot order "
            "them; runs of each can."]



def rehearsal_report(candidates: list[Candidate], out: Path) -> list[str]:
    """``plan.rehearse``: which candidates were costed by a rehearsal of their layout (the model's
    step beside it) and which rehearsals failed (their candidates are listed invalid)."""
    rehearsed = [c for c in candidates if c.costed_by == "rehearsal" and c.rehearsal]
    failed = [c for c in candidates if c.rehearsal and "error" in c.rehearsal]
    if not rehearsed and not failed:
        return []
    lines = [f"\ncosted by rehearsal ({len(rehearsed)} candidates; rehearsals under {out / 'rehearsals'}):"]
    for c in rehearsed:
        assert c.rehearsal is not None and c.predicted_step_time_s is not None
        model = c.rehearsal["model_step_s"]
        lines.append(f"  {label(c)}: {c.predicted_step_time_s * 1e3:.1f} ms (the tp cost model: "
                     f"{model * 1e3:.1f} ms)")
    for c in failed:
        assert c.rehearsal is not None
        lines.append(f"  {label(c)}: {c.rehearsal['error']} (not ranked)")
    return lines
