"""Hugging Face models: a Llama-shaped ``model=hf`` model read from its directory's safetensors,
pipelined at pp=2 (1F1B, ZBV) against its unsplit run: step time, peak memory and the bytes each
rank read of the weights."""

from __future__ import annotations

from typing import Any, Mapping

from bench.common import MIB, median
from bench.markdown import meta_line, num
from bench.runs import Context, alternating_runs
from bench.section import Page, Section

# 8 layers of width 256, an 8192-token vocabulary (random weights saved in its directory: the
# pretrained path); at pp=2 against its unsplit run.
HF_LLAMA = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256}
HF_RUNS = {"pp1": ["parallel.pp=1"], "pp2-1f1b": ["parallel.pp=2", "schedule=1f1b"],
           "pp2-zbv": ["parallel.pp=2", "schedule=zbv"]}


def hf_models(ctx: Context) -> dict[str, Any]:
    """``model=hf``: a Llama-shaped model read from its directory's safetensors, pipelined at pp=2
    (1F1B, ZBV) against its unsplit run in alternating order: step time, peak memory per rank, and
    the bytes each rank read of the weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    model_dir = ctx.work / "hf-llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**HF_LLAMA)).save_pretrained(model_dir)
    file_bytes = sum(p.numel() * p.element_size()
                     for p in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().values())
    common = ["model=hf", f"model.path={model_dir}", f"data.vocab_size={HF_LLAMA['vocab_size']}",
              "train.seq_len=128", "train.batch_size=32", "parallel.microbatches=8", "profile.enabled=false",
              f"train.steps={ctx.args.option_steps}"]
    runs = alternating_runs(ctx, "hf", HF_RUNS, common)
    return {"model": HF_LLAMA, "file_bytes": file_bytes, "overrides": common, "runs": runs}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res, runs = data["results"], data["results"]["runs"]
    model, total = res["model"], res["file_bytes"]
    lines = ["## Hugging Face models", "", meta_line(data["meta"], runs), "",
             f"A Llama-shaped `model=hf` model ({model['num_hidden_layers']} layers of width "
             f"{model['hidden_size']}, {model['vocab_size']}-token vocabulary, untied head; "
             f"{total / MIB:.1f} MiB of fp32 weights) read from its directory's safetensors, "
             "`train.batch_size=32 train.seq_len=128 parallel.microbatches=8`. Steady step: the median from "
             "step 2 on, the median over repeats (runs alternate between the configurations).", "",
             "| config | steady step (s) | / unsplit | peak memory per rank (MiB) | weights read per rank (MiB) "
             "| share of the file per rank |", "|---|---|---|---|---|---|"]
    base = median([r["steady_s"] for r in runs if r["config"] == "pp1" and r.get("steady_s")])
    for name in dict.fromkeys(r["config"] for r in runs):
        ok = [r for r in runs if r["config"] == name and r.get("status") == "ok"]
        if not ok:
            lines.append(f"| {name} | failed: {next(r for r in runs if r['config'] == name).get('error')} | | | | |")
            continue
        step = median([r["steady_s"] for r in ok if r.get("steady_s")])
        mem = ", ".join(f"{b / MIB:.0f}" for b in ok[-1]["peak_mem_bytes"])
        read = ok[-1].get("weights_read_bytes") or []
        ratio = num(step / base if step and base else None, ".2f")
        lines.append(f"| {name} | {num(step, '.4f')} | {ratio} | {mem} | {', '.join(f'{b / MIB:.1f}' for b in read)} "
                     f"| {', '.join(f'{b / total:.2f}' for b in read)} |")
    shares = [b / total for r in runs if r.get("status") == "ok" and len(r.get("weights_read_bytes") or []) > 1
              for b in r["weights_read_bytes"]]
    read_line = (f"Each rank reads only its own stages' tensors: a pipelined rank read {min(shares):.2f}-"
                 f"{max(shares):.2f} of the file (the embedding and the head, the largest tensors, sit on the first "
                 "and the last stage). " if shares else "")
    return lines + ["", read_line + "Peak memory is the process's RSS high-water mark on CPU (interpreter, torch "
                        "and transformers included).", ""]


SECTION = Section("hf", hf_models, render)
