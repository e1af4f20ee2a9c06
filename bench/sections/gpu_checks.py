"""The prepared GPU checks (``scripts/gpu_checks.sh``, docs/testing.md) as a section of
BENCHMARKS-cuda.md: a Llama-1B-shaped model at pp=1 (bf16, fp32, bf16 compiled; tokens/s, MFU,
the runner against a hand-written loop), Llama-3-8B-shaped ranks rehearsed, beside what
``plan.target`` estimates for the same ranks, and the pp=4 rehearsal's times fitted from short
sequences (``rehearse.time_fit_seq_len``) against its full-length ones. CUDA only: it runs the
script on this host's GPU."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any, Mapping

from bench.common import ROOT
from bench.markdown import meta_line
from bench.runs import Context
from bench.section import Page, Section
from bench.sections.rehearsal_scale import TIMER_FLOOR_S

GB = 1e9
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
# plan.target's candidate of the same pipeline layout as each rehearsal (the run's default schedule;
# under DDP, dp changes neither a rank's stage nor its memory).
SAME_LAYOUT = {"rehearse-8b-pp4": {"schedule": "1f1b", "pp": 4, "microbatches": 4, "dp_mode": "ddp"},
               "rehearse-8b-fsdp8": {"schedule": "1f1b", "pp": 1, "microbatches": 1, "dp_mode": "fsdp"}}
# The rehearsal with fitted times (rehearse.time_fit_seq_len) and the full-length one it is held to.
FITTED, FULL = "rehearse-8b-pp4-fit", "rehearse-8b-pp4"


def _rehearsal(run: Path) -> dict[str, Any] | None:
    """A rehearsal's ranks: from rehearsal.json, or (a check cut short by its time limit) from the
    ranks it finished (``rehearsal/rank<r>.json``), marked partial."""
    report = run / "rehearsal.json"
    if report.is_file():
        data = json.loads(report.read_text())
        return {"ranks": data["ranks"], "step": data.get("step"), "partial": False}
    # A rank's own file (rank<r>.json; not rank<r>-time.json, a pass of scaled times).
    ranks = [json.loads(p.read_text()) for p in sorted((run / "rehearsal").glob("rank*.json"))
             if p.stem[4:].isdigit()]
    return {"ranks": ranks, "step": None, "partial": True} if ranks else None


def _target(run: Path) -> list[dict[str, Any]]:
    """plan.target's estimate for the layouts the rehearsals ran (``SAME_LAYOUT``), per rank."""
    plan = run / "plan.json"
    if not plan.is_file():
        return []
    keys = ("schedule", "pp", "dp", "tp", "dp_mode", "microbatches", "memory_per_rank")
    return [{k: c[k] for k in keys} for c in json.loads(plan.read_text())
            if c["valid"] and any(all(c[k] == v for k, v in layout.items()) for layout in SAME_LAYOUT.values())]


def _pp1_run(run: Path) -> dict[str, Any] | None:
    """A pp=1 run's parameters (its model built on meta), precision, tokens/s, step and peak memory."""
    from omegaconf import OmegaConf

    from runner.models.split import build_meta_model

    if not (run / "summary.json").is_file():
        return None
    summary = json.loads((run / "summary.json").read_text())
    cfg = OmegaConf.load(run / "resolved_config.yaml")
    params = sum(p.numel() for p in build_meta_model(cfg.model).module.parameters())
    return {"params": params, "precision": cfg.train.precision,
            **{k: summary[k] for k in ("tokens_per_s", "step_time_s", "peak_mem_bytes")}}


# A recorded action against the trace's range of it (``timeline_check``): durations within 10% and 100 us,
# starts (after the window's first action) within 10% of the action and 200 us.
TIMELINE_REL, TIMELINE_DUR_US, TIMELINE_START_US = 0.1, 100.0, 200.0


def _compute_ranges(events: list[dict[str, Any]], *, device: bool) -> list[dict[str, Any]]:
    return sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("compute:")
                   and (e.get("cat") == "gpu_user_annotation") == device), key=lambda e: e["ts"])


def timeline_check(run: Path) -> dict[str, Any] | None:
    """A profiled pp=1 run's ``timeline.json`` (the recorder's spans: on CUDA the device's, from CUDA
    events placed on the host's clock, ``runner.pipeline.device_spans``) against its rank 0 torch trace's
    ranges of the same actions: on CUDA the device's copies (``gpu_user_annotation``: its first kernel to
    its last), else the host's. Kind by kind (F, B, ...: whether the trace ties a backward's kernels,
    launched by autograd's device thread, to its range is CUDA's profiler's business, so a kind the
    trace holds otherwise is reported, not compared), per action both durations and both starts after
    the kind's first action (``TIMELINE_*``); ``passed`` where the forwards agree, the other kinds'
    verdicts in ``kinds``. None where the run left no timeline."""
    traces = sorted((run / "traces").glob("rank0*.json"))
    if not (run / "timeline.json").is_file() or not traces:
        return None
    ours = sorted((e for e in json.loads((run / "timeline.json").read_text())["traceEvents"]
                   if e.get("ph") == "X" and e.get("pid") == 0 and e.get("tid") == 0), key=lambda e: e["ts"])
    events = json.loads(traces[0].read_text())["traceEvents"]
    theirs = _compute_ranges(events, device=True)
    on = "device" if theirs else "host"
    theirs = theirs or _compute_ranges(events, device=False)
    kinds: dict[str, str] = {}
    rows = []
    for kind in sorted({e["args"]["kind"] for e in ours}):
        mine = [e for e in ours if e["args"]["kind"] == kind]
        same = [e for e in theirs if e["name"] in {m["name"] for m in mine}]
        if [e["name"] for e in mine] != [e["name"] for e in same]:
            kinds[kind] = f"not compared: {len(mine)} recorded, {len(same)} in the trace, not the same actions"
            continue
        first = len(rows)
        for o, t in zip(mine, same):
            start_o, start_t = o["ts"] - mine[0]["ts"], t["ts"] - same[0]["ts"]
            rows.append({"action": o["name"][len("compute:"):], "step": o["args"]["step"], "dur_us": o["dur"],
                         "trace_dur_us": t["dur"], "start_us": start_o, "trace_start_us": start_t,
                         "ok": abs(o["dur"] - t["dur"]) <= TIMELINE_REL * t["dur"] + TIMELINE_DUR_US
                         and abs(start_o - start_t) <= TIMELINE_REL * t["dur"] + TIMELINE_START_US})
        off = sum(not r["ok"] for r in rows[first:])
        kinds[kind] = f"{off} of {len(mine)} differ" if off else "agrees"
    ratios = [r["dur_us"] / r["trace_dur_us"] for r in rows if r["trace_dur_us"] > 0]
    return {"on": on, "passed": kinds.get("F") == "agrees", "kinds": kinds,
            "actions": len(rows),
            "duration_ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            if ratios else None,
            "start_diff_us_max": max((abs(r["start_us"] - r["trace_start_us"]) for r in rows), default=None),
            "rows": rows}


def timeline_main(run: str) -> int:
    """The check's command (scripts/gpu_checks.sh's ``timeline-cuda``): ``timeline_check`` printed, its
    JSON beside the run (``timeline-check.json``); 0 where it passed."""
    result = timeline_check(Path(run))
    if result is None:
        print(f"{run}: no timeline.json or rank 0 trace")
        return 1
    (Path(run) / "timeline-check.json").write_text(json.dumps(result, indent=1))
    for r in result.get("rows", []):
        print(f"{r['action']:>6} step {r['step']}: {r['dur_us']:10.1f} us (trace {r['trace_dur_us']:10.1f}), "
              f"at {r['start_us']:10.1f} us (trace {r['trace_start_us']:10.1f}){'' if r['ok'] else '  <- differs'}")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0 if result["passed"] else 1


def collect(out: Path) -> dict[str, Any]:
    """What a run of the script left in ``out``: its summary lines, the pp=1 runs, the hand-written
    loop's step times, the rehearsed ranks and plan.target's estimates."""
    runs = out / "runs"
    loop = out / "loop-1b-bf16.json"
    return {"summary": (out / "summary.txt").read_text().splitlines() if (out / "summary.txt").is_file() else [],
            "pp1": {p.name: r for p in sorted(runs.glob("1b-*")) if (r := _pp1_run(p))},
            "hand_loop_s": json.loads(loop.read_text()) if loop.is_file() else None,
            "rehearsals": {p.name: r for p in sorted(runs.glob("rehearse-*")) if (r := _rehearsal(p))},
            "target": _target(runs / "target-8b"),
            "timeline": {k: v for k, v in (timeline_check(runs / "timeline-cuda") or {}).items() if k != "rows"}}


def gpu_checks(ctx: Context) -> dict[str, Any]:
    import torch

    out = ctx.work / "gpu-checks"
    subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "OUT": str(out)}, cwd=ROOT, check=False)
    return {"device_name": torch.cuda.get_device_name(0), **collect(out)}


def _pp1_rows(res: Mapping[str, Any]) -> list[str]:
    from runner.plan.roofline import lookup_peaks

    peaks = lookup_peaks(res["device_name"])
    fp32 = res["pp1"].get("1b-fp32")
    rows = ["| run | step (s) | tokens/s | MFU | x fp32 | peak memory (GB) |", "|---|---|---|---|---|---|"]
    for name, r in sorted(res["pp1"].items()):
        bf16 = r["precision"] == "bf16"
        mfu = "?"
        if peaks is not None:
            import torch

            mfu = f"{6 * r['params'] * r['tokens_per_s'] / peaks.peak(torch.bfloat16 if bf16 else torch.float32):.0%}"
        speedup = f"{r['tokens_per_s'] / fp32['tokens_per_s']:.2f}" if fp32 else "-"
        rows.append(f"| {name} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | {speedup} | "
                    f"{max(r['peak_mem_bytes']) / GB:.1f} |")
    return rows


def _rehearsal_rows(res: Mapping[str, Any]) -> list[str]:
    rows = ["| rehearsal | rank | parameters (GB) | gradients (GB) | optimizer (GB) | activations and rest (GB) "
            "| peak (GB) | step (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, reh in res["rehearsals"].items():
        for r in reh["ranks"]:
            p = r["peak_bytes"]
            rows.append(f"| {name}{' (partial)' if reh['partial'] else ''} | {r['rank']} | {p['params'] / GB:.2f} | "
                        f"{p['grads'] / GB:.2f} | {p['optimizer_state'] / GB:.2f} | "
                        f"{p['activations_and_rest'] / GB:.2f} | {p['total'] / GB:.2f} | {_step_cell(r)} |")
    return rows


def _step_cell(rank: Mapping[str, Any]) -> str:
    """A rehearsed rank's timed step (s); with scaled or fitted times, the step measured at the
    short length, said so; "-" where none was timed (a partial rehearsal's memory pass)."""
    if rank.get("step_s") is not None:
        return f"{rank['step_s']:.3f}"
    times = rank.get("times") or {}
    if times.get("measured_step_s") is not None:
        return f"{times['measured_step_s']:.3f} at {times['measured_at_seq_len']} tokens"
    return "-"


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    on = res.get("devices") or f"1 x {res['device_name']}"  # checks of two sessions: each one's device
    lines = [f"## The prepared GPU checks ({on})", "", meta_line(data["meta"]), "",
             "`scripts/gpu_checks.sh` (docs/testing.md): each check's status and seconds: "
             + "; ".join(res["summary"]) + ".", "",
             "A Llama-1B-shaped built-in transformer (`model.dim=2048 model.n_layers=16 model.n_heads=16 "
             "data.vocab_size=32000 train.seq_len=2048 train.batch_size=8`, random init, pp=1, 8 steps; step: the "
             "median from step 1 on). MFU: 6 x parameters x tokens/s over the device's dense peak in the run's "
             "precision from torch's datasheet table (attention FLOPs not counted; fp32 runs without TF32).", "",
             *_pp1_rows(res), ""]
    loop, bf16 = res.get("hand_loop_s"), res["pp1"].get("1b-bf16")
    if loop and bf16:
        loop_s = statistics.median(loop[1:])
        lines += [f"A hand-written loop over the same model, data, clip and AdamW in bf16 "
                  f"(`bench/programs/single_loop.py`): {loop_s:.3f} s a step; the runner's step is "
                  f"{bf16['step_time_s'] / loop_s:.2f}x it.", ""]
    if res["rehearsals"]:
        partial = any(reh["partial"] for reh in res["rehearsals"].values())
        lines += ["Llama-3-8B-shaped ranks rehearsed (`rehearse=on`, a config-only directory: hidden 4096, 32 "
                  "layers, vocabulary 128256; sequence 512, batch 8)."
                  + (" *partial*: the check's time ran out after these ranks; no composed step." if partial else ""),
                  "", *_rehearsal_rows(res), ""]
    fits = [(res["rehearsals"].get(FITTED), res["rehearsals"].get(FULL), "")]
    fits += [(f["fitted"], f["full"], f["note"]) for f in res.get("more_fits", [])]
    return lines + _target_lines(res) + [line for fit in fits for line in _fit_lines(*fit)]


def _action_medians(ranks: list[Mapping[str, Any]]) -> dict[str, float]:
    """Each stage action's time (stage and kind), the median over its microbatches, as the composed
    step takes it (``stage_costs_s``), from the ranks' timed actions."""
    times: dict[str, list[float]] = {}
    for r in ranks:
        for a in r.get("actions") or []:
            times.setdefault(f"{a['stage']}{a['kind']}", []).append(a["seconds"])
    return {k: statistics.median(v) for k, v in sorted(times.items())}


def _fit_lines(fitted: Mapping[str, Any] | None, full: Mapping[str, Any] | None, note: str = "") -> list[str]:
    """The pp=4 rehearsal's times fitted through two short sequences (``fitted``: the ``FITTED``
    check's ranks, rank 3 by default) against the same ranks of the full-length rehearsal of the same
    call (``full``: ``FULL``'s, finished or cut short): each stage action's time as the composed step
    takes it, and the composed step where both composed one (every pipeline rank rehearsed), as the
    CPU section ``rehearsal_scale`` reports them; nothing unless the fit finished and the full length
    has its ranks. ``note``: a later call's (``results["more_fits"]``: where and when it ran)."""
    if not (fitted and full and not fitted["partial"]):
        return []
    ids = {r["rank"] for r in fitted["ranks"]}
    got, base = _action_medians(fitted["ranks"]), _action_medians([r for r in full["ranks"] if r["rank"] in ids])
    if not base:
        return []
    rows = ["| stage action | full length (s) | fitted (s) | fitted / full |", "|---|---|---|---|"]
    for key, full_s in base.items():
        ratio = f"{got[key] / full_s:.2f}" if key in got and full_s >= TIMER_FLOOR_S else ""
        rows.append(f"| {key} | {full_s:.4f} | {got.get(key, float('nan')):.4f} | {ratio} |")
    if fitted["step"] and full["step"]:
        step, fit_step = full["step"]["step_s"], fitted["step"]["step_s"]
        rows.append(f"| step | {step:.4f} | {fit_step:.4f} | {fit_step / step:.2f} |")
    times = fitted["ranks"][0]["times"]
    return [f"The pp=4 rehearsal's rank{'s' if len(ids) > 1 else ''} {', '.join(map(str, sorted(ids)))} again "
            f"({FITTED}) with times measured at {times['fit_seq_len']} and {times['measured_at_seq_len']} tokens "
            f"(`rehearse.time_fit_seq_len`, `rehearse.time_seq_len`) and fitted to {times['scaled_to_seq_len']} (each "
            f"action's line a + b * FLOPs through the two: docs/rehearsal.md), against {FULL}'s times measured at "
            f"{times['scaled_to_seq_len']}: per stage action (stage and kind; the median over microbatches, as the "
            "composed step takes it)" + (" and the composed step" if fitted["step"] and full["step"] else
                                         "; no composed step: not every pipeline rank was fitted") +
            ". Ratios of an action under 1 ms at full length are left out (they measure the timer)."
            + (f" {note}" if note else ""), "", *rows, ""]


def _target_lines(res: Mapping[str, Any]) -> list[str]:
    out = []
    for name, reh in res["rehearsals"].items():
        layout = SAME_LAYOUT.get(name)
        match = [c for c in res["target"] if layout and all(c[k] == v for k, v in layout.items())]
        for r in reh["ranks"] if match else []:
            est, got = match[0]["memory_per_rank"][r["rank"]], r["peak_bytes"]
            out.append(f"- {name} rank {r['rank']}: `plan.target` estimates {est['total'] / GB:.1f} GB "
                       f"({(est['params'] + est['grads'] + est['optimizer']) / GB:.1f} GB of weights, gradients and "
                       f"AdamW state, {est['activations'] / GB:.1f} GB of activations); rehearsed "
                       f"{got['total'] / GB:.1f} GB ({(got['params'] + got['grads'] + got['optimizer_state']) / GB:.1f}"
                       f" and {got['activations_and_rest'] / GB:.1f} GB). The planner balances stages by cost, so "
                       "its split can differ from the run's.")
    return [*out, ""] if out else []


SECTION = Section("gpu_checks", gpu_checks, render, ranks=lambda args: 1, cuda_only=True)
