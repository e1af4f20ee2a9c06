"""The rehearsal's scaled times (``rehearse.time_seq_len``, docs/rehearsal.md) against a full-length
rehearsal: the rehearsal section's sub-run, alone (``python scripts/bench.py --only rehearsal_scale``,
its own JSON), rendered after it. Llama-shaped models whose full-length rehearsal this CPU can run
are rehearsed at ``train.seq_len`` S, with ``rehearse.time_seq_len`` at S/2, S/4 and S/8 (the FLOP
rule), and with ``rehearse.time_fit_seq_len`` too (the fit a + b * FLOPs through S/8 and S/4, and
through S/4 and S/2), in alternating order over repeats; each stage action's composed time and the
composed step, scaled over measured."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Mapping, Sequence

from bench.common import median
from bench.markdown import meta_line, num
from bench.runs import Context, error_line, run_cli
from bench.section import Page, Section

# A Llama shape of about 58M parameters (25M in its 8 decoder layers, 16M each in the embedding and
# the untied head), as config.json only (model.pretrained=false: nothing read, nothing downloaded).
SCALE_LLAMA = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
# Per configuration: the model's overrides and the run's. One thread per rank (a rehearsed rank runs alone).
SCALE_RUNS = {
    "llama-pp2-zbh1-s1024": ["model=hf", "model.pretrained=false", f"data.vocab_size={SCALE_LLAMA['vocab_size']}",
                             "train.seq_len=1024", "train.batch_size=2", "parallel.pp=2", "parallel.microbatches=2",
                             "schedule=zbh1"],
    "builtin-pp4-1f1b-s512": ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "data.vocab_size=32000",
                              "train.seq_len=512", "train.batch_size=4", "parallel.pp=4",
                              "parallel.microbatches=4", "schedule=1f1b"],
}
SCALE_COMMON = ["rehearse=on", "profile.enabled=false", "launch.threads_per_rank=1"]
# (rehearse.time_seq_len, rehearse.time_fit_seq_len) as fractions of train.seq_len; (None, None): full length.
MODES = ((None, None), (2, None), (4, None), (8, None), (4, 8), (2, 4))
TIMER_FLOOR_S = 1e-3  # an action shorter than this at full length (the first stage's I: nothing) gets no ratios


def _seq_len(overrides: list[str]) -> int:
    return int(next(o for o in overrides if o.startswith("train.seq_len=")).split("=", 1)[1])


def _read(report: Mapping[str, Any]) -> dict[str, Any]:
    """What one rehearsal.json gives the table: the composed step and each stage action's composed
    (median over microbatches) time."""
    step = report["step"]
    return {"step_s": step["step_s"], "pipeline_s": step["pipeline_s"], "stage_costs_s": step["stage_costs_s"],
            "times_are": report["times_are"]}


def mode_name(mode: Sequence[int | None]) -> str:
    """``full``, ``S/4`` (scaled from S/4) or ``fit S/8, S/4`` (fitted through S/8 and S/4)."""
    short, fit = mode
    return "full" if short is None else f"S/{short}" if fit is None else f"fit S/{fit}, S/{short}"


def _rehearse(ctx: Context, name: str, repeat: int, mode: Sequence[int | None]) -> dict[str, Any]:
    seq_len, (short, fit) = _seq_len(SCALE_RUNS[name]), mode
    keys = ([f"rehearse.time_seq_len={seq_len // short}"] if short else []) + (
        [f"rehearse.time_fit_seq_len={seq_len // fit}"] if fit else [])
    # No comma in the directory: Hydra reads an override with one as a sweep.
    run_dir = ctx.work / f"rehearsal-scale-{name}-{short or 'full'}-{fit or 'flops'}-{repeat}"
    extra = [f"model.path={ctx.work / 'rehearsal-scale-llama'}"] if "model=hf" in SCALE_RUNS[name] else []
    started = time.time()
    done = run_cli(ctx, *SCALE_COMMON, *SCALE_RUNS[name], *extra, *keys, f"hydra.run.dir={run_dir}")
    run: dict[str, Any] = {"config": name, "repeat": repeat, "mode": mode_name(mode)}
    report_file = run_dir / "rehearsal.json"
    if not report_file.is_file() or not json.loads(report_file.read_text()).get("step"):
        return {**run, "status": "failed", "error": error_line(run_dir, done)}
    return ctx.mark({**run, "status": "ok", **_read(json.loads(report_file.read_text())), "started_at": started,
                     "finished_at": time.time(), "wall_s": time.time() - started})


def rehearsal_scale(ctx: Context) -> dict[str, Any]:
    """Each configuration rehearsed in every mode, ``option_repeats`` times, the modes in forward
    then reverse order (a drifting load favours none)."""
    from transformers import LlamaConfig

    LlamaConfig(**SCALE_LLAMA).save_pretrained(ctx.work / "rehearsal-scale-llama")  # config.json only
    runs = []
    for name in SCALE_RUNS:
        for repeat in range(ctx.args.option_repeats):
            for mode in MODES if repeat % 2 == 0 else reversed(MODES):
                runs.append(_rehearse(ctx, name, repeat, mode))
                print(f"[bench] rehearsal scale {name} {mode_name(mode)} #{repeat}: "
                      f"{runs[-1].get('step_s') or runs[-1].get('error')}", flush=True)
    return {"llama": SCALE_LLAMA, "configs": SCALE_RUNS, "common": SCALE_COMMON,
            "modes": [mode_name(m) for m in MODES], "runs": runs}


def _medians(runs: list[Mapping[str, Any]], field: str) -> dict[str, float]:
    """Each key of ``field`` (a dict per run), its median over the runs."""
    keys = sorted({k for r in runs for k in r[field]})
    return {k: statistics.median(r[field][k] for r in runs if k in r[field]) for k in keys}


def _config_rows(res: Mapping[str, Any], name: str) -> list[str]:
    ok = [r for r in res["runs"] if r["config"] == name and r.get("status") == "ok"]
    by_mode = {m: [r for r in ok if r["mode"] == m] for m in res["modes"]}
    failed = [r for r in res["runs"] if r["config"] == name and r.get("status") != "ok"]
    star = "*" if any(r.get("under_load") for r in ok) else ""
    full, scaled = by_mode["full"], [m for m in res["modes"] if m != "full"]
    if not full:
        return [f"| {name} | failed: {failed[0]['error'] if failed else 'not run'} |"]
    base = _medians(full, "stage_costs_s")
    costs = {m: _medians(by_mode[m], "stage_costs_s") if by_mode[m] else {} for m in scaled}
    rows = []
    for key, full_s in base.items():
        cells = [num(costs[m][key] / full_s if costs[m].get(key) and full_s >= TIMER_FLOOR_S else None, ".2f")
                 for m in scaled]
        rows.append(f"| {name}{star} | {key} | {full_s:.4f} | " + " | ".join(cells) + " |")
    step = median([r["step_s"] for r in full])
    cells = [num(median([r["step_s"] for r in by_mode[m]]) / step if by_mode[m] and step else None, ".2f")
             for m in scaled]
    rows.append(f"| {name}{star} | step | {step:.4f} | " + " | ".join(cells) + " |")
    return rows + [f"| {name} | failed: {r['mode']}: {r['error']} |" for r in failed]


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    scaled = [m for m in res["modes"] if m != "full"]
    llama = res["llama"]
    lines = ["## Rehearsal: times scaled from a shorter sequence, against a full-length rehearsal", "",
             meta_line(data["meta"], res["runs"]), "",
             "Each configuration (`" + " ".join(res["common"]) + "`, then: "
             + "; ".join(f"{n}: `{' '.join(o)}`" for n, o in res["configs"].items())
             + f"; the Llama shape: hidden {llama['hidden_size']}, intermediate {llama['intermediate_size']}, "
               f"{llama['num_hidden_layers']} layers, {llama['num_attention_heads']} heads "
               f"({llama['num_key_value_heads']} key/value), vocabulary {llama['vocab_size']}, as `config.json` only) "
               "is rehearsed at its `train.seq_len` S (full), with `rehearse.time_seq_len` at S/2, S/4 and S/8 "
               "(S/n: the FLOP rule), and with `rehearse.time_fit_seq_len` too (fit S/8, S/4: the line a + b * FLOPs "
               "through the times at S/8 and S/4), the modes in alternating order over repeats. Per stage action "
               "(stage and kind; the composed step's median over microbatches, the median over repeats): the "
               "full-length time, then each mode's time over it; the step row: the composed step's. docs/rehearsal.md "
               "states both rules.", "",
             "| config | stage action | full length (s) | " + " | ".join(f"{m} / full" for m in scaled) + " |",
             "|---|---|---|" + "---|" * len(scaled)]
    for name in res["configs"]:
        lines += _config_rows(res, name)
    lines += ["", "Ratios of an action under 1 ms at full length (the first stage's I, which runs nothing, an "
                  "embedding's forward) are left out: they measure the timer."]
    if any(r.get("under_load") for r in res["runs"]):
        lines += ["", "Configurations marked * had runs that shared the machine with other work: a full-length and a "
                      "scaled rehearsal were slowed by different amounts at different times, so their ratios measure "
                      "the load as much as the rule. "
                      "Re-run on a quiet machine before reading them as accuracy; docs/rehearsal.md (\"How close the "
                      "scaled times are\") has the same comparison in CPU time, which the load moves little."]
    return lines + [""]


def _one_rank(args) -> int:
    return 1  # the rehearsed ranks run one at a time


SECTION = Section("rehearsal_scale", rehearsal_scale, render, ranks=_one_rank)
