"""Tensor parallelism: the benchmark model on 4 ranks laid out four ways (pp=4; pp=2 x tp=2;
dp=2 x pp=2; tp=4 unsplit), in alternating order: step time, tokens/s and peak memory per rank,
as ratios to pp=4 measured in the same run."""

from __future__ import annotations

from typing import Any, Mapping

from bench.common import MIB, MODEL, median
from bench.markdown import meta_line, num
from bench.runs import Context, alternating_runs
from bench.section import Page, Section

# The same 4 ranks and global batch (32 samples, 8 microbatches per pipeline) each way; the
# replicas of dp=2 keep in step with DDP and split the batch (4 microbatches of 4 samples each).
TP_RUNS = {
    "pp4": ["parallel.pp=4", "parallel.microbatches=8"],
    "pp2-tp2": ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=8"],
    "dp2-pp2": ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp", "parallel.microbatches=4"],
    "tp4": ["parallel.pp=1", "parallel.tp=4", "parallel.microbatches=8"],
}


def _ranks(args) -> int:
    return 4


def tp_layouts(ctx: Context) -> dict[str, Any]:
    common = [*MODEL, "schedule=1f1b", "profile.enabled=false", f"train.steps={ctx.args.option_steps}"]
    runs = alternating_runs(ctx, "tp", TP_RUNS, common)
    return {"overrides": common, "layouts": TP_RUNS, "runs": runs}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res, runs = data["results"], data["results"]["runs"]
    lines = ["## Tensor parallelism: pp x tp x dp on the same ranks", "", meta_line(data["meta"], runs), "",
             "The benchmark model (`" + " ".join(res["overrides"]) + "`) on 4 ranks, four ways: "
             + "; ".join(f"{name}: `{' '.join(o)}`" for name, o in res["layouts"].items())
             + ". Steady step: the median from step 2 on, the median over repeats (runs alternate). "
               "Ratios are to pp=4 from the same run of this section.", "",
             "| layout | steady step (s) | / pp=4 | tokens/s | / pp=4 | peak memory per rank (MiB) | max / pp=4 |",
             "|---|---|---|---|---|---|---|"]

    def summary(name: str) -> tuple[float | None, float | None, list[int]]:
        ok = [r for r in runs if r["config"] == name and r.get("status") == "ok"]
        if not ok:
            return None, None, []
        return (median([r["steady_s"] for r in ok if r.get("steady_s")]),
                median([r["tokens_per_s"] for r in ok if r.get("tokens_per_s")]), ok[-1]["peak_mem_bytes"] or [])

    base_step, base_tokens, base_mem = summary("pp4")
    for name in res["layouts"]:
        step, tokens, mem = summary(name)
        if step is None:
            error = next((r.get("error") for r in runs if r["config"] == name), "not run")
            lines.append(f"| {name} | failed: {error} | | | | | |")
            continue
        lines.append(
            f"| {name} | {num(step, '.3f')} | {num(step / base_step if base_step else None, '.2f')} "
            f"| {num(tokens, '.0f')} | {num(tokens / base_tokens if tokens and base_tokens else None, '.2f')} "
            f"| {', '.join(f'{b / MIB:.0f}' for b in mem)} "
            f"| {num(max(mem) / max(base_mem) if mem and base_mem else None, '.2f')} |")
    return lines + ["", _MEANING, ""]


# What the table shows on a CPU host (the same words whatever the numbers: the ratios say how much).
_MEANING = (
    "What it means: on CPU over gloo, tensor parallelism's collectives sit on the critical path of every "
    "microbatch. Each block all-reduces its activations twice in the forward (the attention's and the "
    "feed-forward's rowwise output) and twice in the backward (the colwise layers' input gradients): at pp=2 x "
    "tp=2 that is 4 blocks x 4 x 8 microbatches = 128 all-reduces of a microbatch's activations (4 x 128 x 256 "
    "fp32, 512 KiB) per rank per step, plus the embedding's and the head's, where the pipeline sends one message "
    "per stage boundary and microbatch; at tp=4 every rank joins 256 of them over four ranks. Loopback gloo "
    "moves them through memory copies on the same cores that compute, so tp=2 is slower than pp=4 and "
    "dp=2 x pp=2 here, and tp=4 far slower. Peak memory is the process's RSS, mostly the interpreter and torch: "
    "what tp saves (1/tp of each block's weights, gradients and optimizer state per rank) is small beside it at "
    "this size. On GPUs joined by NVLink an all-reduce of this size takes microseconds and tp inside a node is "
    "the usual choice for a model whose layers do not fit one device (docs/parallelism.md); the planner "
    "(`plan.search_degrees=true`) costs these all-reduces from its calibration before choosing.")


SECTION = Section("tp", tp_layouts, render, ranks=_ranks)
