"""Scaling: step time over pp and m, and each rank's peak memory against the activations its
schedule's order keeps in flight (the efficiency sweep's runs: none of its own)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Mapping, Sequence

from bench.common import MIB, SCHEDULES, SWEEP_MODEL, compose, linear_fit
from bench.markdown import meta_line, num, star
from bench.runs import Context, save
from bench.section import Page, Section
from bench.sections.efficiency import efficiency


def activation_bytes_per_sample(overrides: Sequence[str], samples: int = 4) -> dict[str, float]:
    """Bytes each top-level model child keeps for backward, per sample: the storages autograd saves
    in its forward (parameters and storages already counted excluded), the loss's with the last."""
    import torch

    from runner.losses import cross_entropy
    from runner.models.split import build_meta_model, materialize

    cfg = compose(overrides)
    meta = build_meta_model(cfg.model)
    model = materialize(meta, meta.unit_names, seed=0, device=torch.device("cpu"))
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randint(cfg.data.vocab_size, (samples, cfg.train.seq_len))
    targets = torch.randint(cfg.data.vocab_size, (samples, cfg.train.seq_len))
    out: dict[str, float] = {}
    names = meta.unit_names
    kept = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            kept["bytes"] += storage.nbytes()
        return t

    for i, name in enumerate(names):
        kept["bytes"] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = model.get_submodule(name)(x)
            if i == len(names) - 1:
                cross_entropy(x, targets)
        out[name] = kept["bytes"] / samples
    return out


def _efficiency_rows(ctx: Context) -> list[dict[str, Any]]:
    """The efficiency sweep's runs: from benchmarks/efficiency.json when it covers --pp and
    --microbatches, else the sweep is run (and efficiency.json refreshed)."""
    path = ctx.args.results / "efficiency.json"
    if path.is_file():
        data = json.loads(path.read_text())["results"]
        have = {(r["pp"], r["m"]) for r in data["runs"]}
        if all((pp, m) in have for pp in ctx.args.pp for m in ctx.args.microbatches):
            return [r for r in data["runs"] if r["pp"] in ctx.args.pp and r["m"] in ctx.args.microbatches]
    print("[bench] scaling: benchmarks/efficiency.json missing or partial; running the efficiency sweep", flush=True)
    ctx.quiet("scaling: efficiency sweep")
    results = efficiency(ctx)
    save(ctx.args.results, "efficiency", results, ctx, started=time.time(), duration_s=None)
    return results["runs"]


def scaling(ctx: Context) -> dict[str, Any]:
    """Step time over pp and m, and peak memory per rank against the activations each schedule's
    order keeps in flight (no runs of its own: the efficiency sweep's)."""
    from runner.pipeline.schedule import is_single_stage, schedule_order
    from runner.pipeline.simulate import peak_in_flight

    runs = _efficiency_rows(ctx)
    per_sample = activation_bytes_per_sample(SWEEP_MODEL)
    batch = int(next(o for o in SWEEP_MODEL if o.startswith("train.batch_size=")).split("=")[1])
    rows = []
    for r in runs:
        spr = (r.get("num_stages") or 0) // r["pp"] or (1 if is_single_stage(r["schedule"]) else 2)
        row = {k: r.get(k) for k in ("pp", "schedule", "m", "status", "step_time_s", "tokens_per_s", "peak_mem_bytes",
                                     "under_load", "rerun") if k in r}
        row["stages_per_rank"] = spr
        try:
            order = schedule_order(r["schedule"], r["pp"], r["m"], spr)
        except Exception as e:  # an order torch refuses: recorded, not fatal
            row["order_error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            continue
        row["expected_in_flight"] = [peak_in_flight(order)[k] for k in sorted(order)]
        if r.get("stages"):
            stage_bytes = {int(s): sum(per_sample.get(n, 0.0) for n in names) * batch / r["m"]
                           for s, names in r["stages"].items()}
            peaks = peak_in_flight(order, stage_bytes)
            row["expected_activation_bytes"] = [round(peaks[k]) for k in sorted(order)]
        rows.append(row)
    return {"model": SWEEP_MODEL, "activation_bytes_per_sample": per_sample, "rows": rows}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    rows = res.get("rows", [])
    lines = ["## Scaling: step time and memory over pp and m", "", meta_line(data["meta"]), "",
             "From the efficiency sweep's runs (same model, same invocation: no runs of its own; * marks a run "
             "that shared the machine, as in the efficiency table). The total work per "
             "step is fixed (64 samples), so with perfect scaling the step time would fall as 1/pp on enough cores; "
             "on 2 cores pp=4 cannot be faster than pp=2.", "", "### Step time (s)", ""]
    keys = sorted({(r["pp"], r["m"]) for r in rows})
    lines += ["| schedule | " + " | ".join(f"pp={pp} m={m}" for pp, m in keys) + " |",
              "|---|" + "---|" * len(keys)]
    for name in SCHEDULES:
        cells = []
        for pp, m in keys:
            r = next((x for x in rows if x["schedule"] == name and x["pp"] == pp and x["m"] == m), None)
            cells.append(num(r.get("step_time_s")) + star(r) if r and r.get("status") == "ok"
                         else "failed" if r else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += _wider_pipeline(rows, (data["meta"].get("machine") or {}).get("cores"))
    lines += ["", "### Peak memory per rank against activations in flight", "",
              "Expected in flight: per rank, the most stage-microbatches whose forward has run and whose activations "
              "are not yet freed, walking the rank's op order from "
              "`runner.pipeline.schedule.schedule_order` (freed by B, or by "
              "W for schedules that split backward into I and W: an upper bound there, as I may free part of them). "
              "Interleaved and V schedules count stages of half the size, so the expected activation MiB (each "
              "stage's saved-for-backward bytes per microbatch, measured in-process from autograd's saved tensors, "
              "times the order's peak) is the comparable column. Measured: the rank's peak RSS (`ru_maxrss`), which "
              "also holds the Python process, torch, the stage's parameters, gradients and AdamW state, and whatever "
              "the allocator keeps: coarse on CPU. Compare schedules at the same pp and m, and the fit below.", ""]
    per_sample = res.get("activation_bytes_per_sample") or {}
    if per_sample:
        total = sum(per_sample.values())
        lines += [f"Saved for backward: {total / MIB:.1f} MiB per sample through the whole model "
                  f"({', '.join(f'{k} {v / MIB:.2f}' for k, v in per_sample.items())} MiB).", ""]
    for pp in sorted({r["pp"] for r in rows}):
        pts = [(e, p) for r in rows if r["pp"] == pp and r.get("status") == "ok" and r.get("peak_mem_bytes")
               and r.get("expected_activation_bytes")
               for e, p in zip(r["expected_activation_bytes"], r["peak_mem_bytes"])]
        fit = linear_fit([e / MIB for e, _ in pts], [p / MIB for _, p in pts])
        if fit:
            a, b, rr = fit
            lines.append(f"- pp={pp}: peak RSS ≈ {a:.0f} MiB + {b:.2f} x expected activations (r = {rr:.2f}, "
                         f"{len(pts)} rank-runs).")
    lines += ["", "| pp | m | schedule | expected in flight (stage-mb per rank) | expected activations MiB per rank | "
              "peak RSS MiB per rank |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda x: (x["pp"], x["m"], SCHEDULES.index(x["schedule"])
                                         if x["schedule"] in SCHEDULES else 99)):
        counts = " / ".join(str(c) for c in r.get("expected_in_flight") or []) or r.get("order_error", "")
        act = " / ".join(f"{b / MIB:.0f}" for b in r.get("expected_activation_bytes") or [])
        rss = " / ".join(f"{b / MIB:.0f}" for b in r.get("peak_mem_bytes") or []) if r.get("status") == "ok" \
            else "failed"
        lines.append(f"| {r['pp']} | {r['m']} | {r['schedule']}{star(r)} | {counts} | {act} | {rss} |")
    return lines + [""]


def _wider_pipeline(rows: Sequence[Mapping[str, Any]], cores: int | None) -> list[str]:
    """The step time at the widest pp over the narrowest, per schedule and m that ran at both."""
    pps = sorted({r["pp"] for r in rows})
    if len(pps) < 2:
        return []
    narrow, wide = pps[0], pps[-1]
    ok = {(r["pp"], r["schedule"], r["m"]): r["step_time_s"] for r in rows
          if r.get("status") == "ok" and r.get("step_time_s")}
    ratios = [ok[(wide, s, m)] / t for (pp, s, m), t in ok.items() if pp == narrow and (wide, s, m) in ok]
    if not ratios:
        return []
    turns = (f" {wide} ranks on {cores} cores take turns on them, so the wider pipeline cannot be faster here."
             if cores and wide > cores else "")
    return ["", f"pp={wide} over pp={narrow}, the same schedule and m: step time x{statistics.median(ratios):.2f} "
                f"(median over {len(ratios)} pairs, x{min(ratios):.2f}-x{max(ratios):.2f}).{turns}"]


SECTION = Section("scaling", scaling, render, ranks=lambda args: max(args.pp), times_runs=False)
