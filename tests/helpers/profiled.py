"""What a profiled run's files hold (test_cli runs one: the run every CLI test already pays for),
and the README's table of HolisticTraceAnalysis on CPU traces, claim by claim."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest


def check_profiled_run(run_dir: Path, *, pp: int, microbatches: int, active_steps: list[int]) -> None:
    """Contents of a profiled 1F1B run's files."""
    summary = json.loads((run_dir / "summary.json").read_text())
    bubble = summary["bubble"]
    assert bubble["steps"] == active_steps
    assert len(bubble["per_rank"]) == pp and all(0 <= b < 1 for b in bubble["per_rank"])
    assert bubble["theoretical"] == pytest.approx((pp - 1) / (microbatches + pp - 1))
    # Per-rank torch traces: our compute ranges, m F and m B per stage per recorded step.
    for rank in range(pp):
        trace = json.loads((run_dir / "traces" / f"rank{rank}.json").read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == pp
        names = Counter(e["name"][len("compute:"):][:2] for e in trace["traceEvents"]
                        if e.get("ph") == "X" and e.get("name", "").startswith("compute:"))
        assert names == {f"{rank}F": microbatches * len(active_steps), f"{rank}B": microbatches * len(active_steps)}
    # The merged timeline: a process per rank, every compute action, a flow per message.
    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {f"rank {r}" for r in range(pp)}
    computes = [e for e in events if e["ph"] == "X" and e["name"].startswith("compute:")]
    assert len(computes) == 2 * microbatches * pp * len(active_steps)
    starts = Counter(e["name"] for e in events if e["ph"] == "s")
    assert starts == {"activation": microbatches * (pp - 1) * len(active_steps),
                      "gradient": microbatches * (pp - 1) * len(active_steps)}
    assert sum(e["ph"] == "f" for e in events) == sum(starts.values())
    # Ranks share the host's monotonic clock: every message arrives after it was sent.
    sent = {e["id"]: e["ts"] for e in events if e["ph"] == "s"}
    late = [(e["name"], e["ts"] - sent[e["id"]]) for e in events if e["ph"] == "f" and e["ts"] < sent[e["id"]]]
    assert not late, f"arrows pointing backwards in time (name, microseconds): {late}"
    assert json.loads((run_dir / "timeline.json").read_text())["otherData"]["clock"].startswith("one host")
    sim = json.loads((run_dir / "schedule_sim.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in sim) == 2 * microbatches * pp
    # The replay's step: at least one rank's mean compute, at most the whole measured step (it leaves
    # out the time between actions and the optimizer).
    mean_busy = max(microbatches * (bubble["mean_costs_s"][f"{r}F"] + bubble["mean_costs_s"][f"{r}B"])
                    for r in range(pp))
    assert mean_busy <= bubble["simulated_step_s"] <= summary["step_time_s"] * 1.5
    # The pipeline call holds every compute action of the step. It runs from the first rank in to the
    # last rank out, and ranks enter a step when their own optimizer is done, so it can outlast rank
    # 0's step time (the metrics) by that skew, though never the time between two steps' loss
    # all-reduces: against the same (profiled, so slower) steps' times, with room for the skew.
    times = {r["step"]: r["step_time_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert mean_busy <= bubble["pipeline_step_s"] <= 2 * statistics.median(times[s] for s in active_steps)
    assert max(e["ts"] + e["dur"] for e in sim if e["ph"] == "X") == pytest.approx(bubble["simulated_step_s"] * 1e6)
    assert (run_dir / "schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = (run_dir / "schedule.csv").read_text().splitlines()
    assert rows[-1] == ",".join(f"{pp - 1}{k}{i}" for i in range(microbatches) for k in "FB")  # last rank: F,B,...
    check_hta_on_cpu_traces(run_dir, pp=pp, microbatches=microbatches, active_steps=active_steps)


def _fails_or_finds_nothing(call) -> bool:
    try:
        result = call()
    except Exception:
        return True
    frames = result if isinstance(result, tuple) else (result,)
    return all(f is None or len(f) == 0 or f.drop(columns="rank", errors="ignore").isna().all().all()
               for f in frames)


def check_hta_on_cpu_traces(run_dir: Path, *, pp: int, microbatches: int, active_steps: list[int]) -> None:
    """The README's table of HolisticTraceAnalysis on CPU traces, claim by claim."""
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=str(run_dir / "traces"))
    # Works: loading every rank (from torch's distributedInfo), the profiler steps (our numbers;
    # HTA leaves out the last, as incomplete), and each rank's events of those steps as a
    # DataFrame, our compute ranges included.
    assert sorted(analysis.t.traces) == list(range(pp))
    steps = analysis.get_profiler_steps()
    assert steps and set(steps) <= set(active_steps)
    for rank in range(pp):
        frame = analysis.t.get_trace(rank)
        names = frame["name"].map(analysis.t.symbol_table.get_sym_table().__getitem__)
        computes = frame[names.str.startswith("compute:")]
        assert len(computes) == 2 * microbatches * len(steps) and (computes["dur"] > 0).all()
    # Need GPU kernels: on CPU traces each raises or finds nothing.
    gpu_only = {
        "temporal breakdown": analysis.get_temporal_breakdown,
        "idle time breakdown": analysis.get_idle_time_breakdown,
        "kernel breakdown": analysis.get_gpu_kernel_breakdown,
        "communication/computation overlap": analysis.get_comm_comp_overlap,
        "potential stragglers": analysis.get_potential_stragglers,
        "operator to kernel delay": analysis.get_aten_op_kernels_and_delay,
        "critical path": lambda: analysis.critical_path_analysis(rank=0, annotation="ProfilerStep", instance_id=0)[1]
        or None,
    }
    working = [name for name, call in gpu_only.items() if not _fails_or_finds_nothing(call)]
    assert not working, f"HTA now analyses CPU traces for {working}: update the README's HTA table"
