"""What one device measures on its own (the section a host with one GPU can run: NCCL cannot put
two ranks on one GPU): per-stage F/B/I/W costs as the planner times them, and the training
options on the unsplit model."""

from __future__ import annotations

from typing import Any, Mapping

from bench.common import MIB, MODEL, SWEEP_MODEL, compose
from bench.machine import device_name
from bench.markdown import meta_line, ratio_table
from bench.runs import Context
from bench.section import Page, Section
from bench.sections.options import observations, option_runs, option_table

# One device, pp=1 (the unsplit model): the options without a pipeline.
SINGLE = {"pp1": [], "pp1+ac": ["train.activation_checkpointing=full"], "pp1+bf16": ["train.precision=bf16"],
          "pp1+compile": ["train.compile=true"]}
SINGLE_LIMITS = {"pp1+bf16": {"steps": 3, "repeats": 1}}  # on CPU only (no native bf16 here)
SINGLE_RATIOS = [("activation checkpointing full / none", "pp1+ac", "pp1"), ("bf16 / fp32", "pp1+bf16", "pp1"),
                 ("compile / eager", "pp1+compile", "pp1")]


def single_device(ctx: Context) -> dict[str, Any]:
    """What one device measures on its own (a host with one GPU: NCCL cannot put two ranks on it):
    each stage's F/B/I/W time for the efficiency model split in 2 and in 4 stages, timed in one
    process as the planner times them, and pp=1 runs of the training options (steady step, peak
    memory: ``max_memory_allocated`` on a GPU, RSS on CPU)."""
    import torch

    from runner.models.split import build_meta_model, plan_split
    from runner.plan.costs import measure_child_costs, stage_costs

    cfg = compose(SWEEP_MODEL)
    device = torch.device("cuda", 0) if ctx.args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)  # as one rank of a CPU run
    microbatches = 8
    costs = measure_child_costs(cfg, cfg.train.batch_size // microbatches, 5, device)
    meta = build_meta_model(cfg.model)
    stages = []
    for num_stages in (2, 4):
        split = plan_split(meta, num_stages, None)
        fbiw = stage_costs(split, costs)
        for s, names in enumerate(split):
            stages.append({"num_stages": num_stages, "stage": s, "children": list(names),
                           **{f"{kind}_s": fbiw[(s, kind)] for kind in "FBIW"},
                           **{k: sum(getattr(costs[n], k) for n in names) for k in ("update_s", "saved_bytes")}})
    table = {name: [*o, "parallel.pp=1", f"parallel.microbatches={microbatches}"] for name, o in SINGLE.items()}
    limits = SINGLE_LIMITS if ctx.args.device == "cpu" else {}
    return {"model": SWEEP_MODEL, "microbatches": microbatches, "device_name": device_name(ctx.args.device),
            "stages": stages, "options_model": MODEL, "steps": ctx.args.option_steps,
            "repeats": ctx.args.option_repeats, "limits": limits, "runs": option_runs(ctx, table, limits, "device")}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    lines = [f"## One device ({res['device_name']}): per-stage costs and the options at pp=1", "",
             meta_line(data["meta"], runs), "",
             "Each stage of the efficiency model (`" + " ".join(res["model"]) + f"`) on one microbatch (m="
             f"{res['microbatches']}), split in 2 and in 4 stages, timed in one process as `python -m runner.plan` "
             "times it (median of 5): forward, full backward, and the zero-bubble split of it as torch's stages "
             "run it, input backward (I) then weight backward (W; the first stage's input takes no gradient, so "
             "its W is the whole backward), the optimizer update of its parameters, and the activations its "
             "forward saves.", "",
             "| stages | stage | children | F (ms) | B (ms) | I (ms) | W (ms) | update (ms) | saved (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for st in res["stages"]:
        f, b, i, w = (st[f"{kind}_s"] * 1e3 for kind in "FBIW")
        lines.append(f"| {st['num_stages']} | {st['stage']} | {', '.join(st['children'])} | {f:.1f} | {b:.1f} | "
                     f"{i:.1f} | {w:.1f} | {st['update_s'] * 1e3:.1f} | {st['saved_bytes'] / MIB:.1f} |")
    lines += _split_backward(res["stages"])
    table, ratios = option_table(runs, SINGLE, SINGLE_RATIOS)
    lines += ["", "The training options on the unsplit model (`parallel.pp=1`, m=8, model `"
              + " ".join(res["options_model"]) + f"`), {res['steps']} steps, profiling off, "
              f"{res['repeats']} repeats (order reversed on odd repeats); steady = median step from step 2 on; "
              "peak memory is `torch.cuda.max_memory_allocated` on a GPU, RSS on CPU."
              + "".join(f" `{n}`: {lim.get('steps')} steps, {lim.get('repeats')} repeat(s) only."
                        for n, lim in (res.get("limits") or {}).items()), ""]
    notes = observations(runs, ratios, SINGLE_RATIOS, (data["meta"].get("machine") or {}).get("device"))
    return lines + ratio_table(ratios, SINGLE_RATIOS) + ["", *notes, "", *table, ""]


def _split_backward(stages: list[Mapping[str, Any]]) -> list[str]:
    """I + W against the full backward, over the stages whose input takes a gradient."""
    split = [(st["I_s"] + st["W_s"]) / st["B_s"] for st in stages if st["I_s"] > 0 and st["B_s"] > 0]
    if not split:
        return []
    return ["", f"I + W is x{min(split):.2f}-x{max(split):.2f} a stage's full backward (the stages after the "
                "first; W runs one autograd pass per parameter group); the first stage's I is zero and its W the "
                "whole backward."]


SECTION = Section("device", single_device, render, ranks=lambda args: 1)
