"""Training options at pp=2, m=8: what activation checkpointing, bf16, compile and pinning ranks
to cores cost against the same schedule without them, in alternating repeats (also the option
runs of ``device``)."""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping, Sequence

from bench.common import MIB, MODEL, find, steady
from bench.markdown import meta_line, num, ratio_table, star
from bench.runs import Context, read_run, run_cli
from bench.section import Page, Section

OPTIONS = {  # name -> overrides, at pp=2 m=8; ratios are taken against the baseline named in OPTION_RATIOS
    "1f1b": ["schedule=1f1b"],
    "1f1b+ac": ["schedule=1f1b", "train.activation_checkpointing=full"],
    "zbv": ["schedule=zbv"],
    "zbv+ac": ["schedule=zbv", "train.activation_checkpointing=full"],
    "1f1b+bf16": ["schedule=1f1b", "train.precision=bf16"],
    "1f1b+compile": ["schedule=1f1b", "train.compile=true"],
    "1f1b-unpinned": ["schedule=1f1b", "launch.pin_cpus=false"],
}
# bf16 matmuls run several times slower than fp32 on a CPU without native bf16 (AVX2 only): fewer steps, one
# repeat.
OPTION_LIMITS = {"1f1b+bf16": {"steps": 4, "repeats": 1}}
OPTION_RATIOS = [  # (label, config, baseline)
    ("activation checkpointing full / none, 1f1b", "1f1b+ac", "1f1b"),
    ("activation checkpointing full / none, zbv", "zbv+ac", "zbv"),
    ("bf16 / fp32, 1f1b", "1f1b+bf16", "1f1b"),
    ("compile / eager, 1f1b", "1f1b+compile", "1f1b"),
    ("ranks pinned / not pinned (launch.pin_cpus), 1f1b", "1f1b", "1f1b-unpinned"),
    ("zbv / 1f1b (no options)", "zbv", "1f1b"),
]


def _option_run(ctx: Context, name: str, overrides: Sequence[str], repeat: int, steps: int,
                tag: str = "") -> dict[str, Any]:
    run_dir = ctx.work / f"option-{name}-{repeat}{tag}"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(ctx.work / f"inductor-{name}-{repeat}{tag}")}  # compile from cold each time
    done = run_cli(ctx, *overrides, f"train.steps={steps}", "profile.enabled=false", *MODEL,
                   f"hydra.run.dir={run_dir}", env=env)
    run = read_run(run_dir, done)
    if run["status"] == "ok":
        times = run["step_times"]
        run.update(steady_s=steady(times, skip=2), first_step_s=times[0] if times else None,
                   second_step_s=times[1] if len(times) > 1 else None)
    return {"config": name, "repeat": repeat, "overrides": list(overrides), "steps": steps, **run}


def option_runs(ctx: Context, table: Mapping[str, Sequence[str]], limits: Mapping[str, Mapping[str, int]],
                 label: str) -> list[dict[str, Any]]:
    """Every config of ``table`` once per repeat, the order reversed on odd repeats."""
    a = ctx.args
    runs = []
    for repeat in range(a.option_repeats):
        if repeat:
            ctx.quiet(f"{label} repeat {repeat}")
        names = list(table) if repeat % 2 == 0 else list(reversed(table))
        for name in names:
            limit = limits.get(name, {})
            if repeat >= limit.get("repeats", a.option_repeats):
                continue
            runs.append(ctx.mark(_option_run(ctx, name, table[name], repeat, limit.get("steps", a.option_steps))))
            r = runs[-1]
            print(f"[bench] {label} {name} #{repeat}: {r.get('steady_s') or r.get('error')}"
                  f"{' (under load)' if r.get('under_load') else ''}", flush=True)
    return ctx.rerun_loaded(
        runs, lambda r: _option_run(ctx, r["config"], r["overrides"], r["repeat"], r["steps"], "-rerun"), label)


def options(ctx: Context) -> dict[str, Any]:
    """Training options at pp=2 m=8."""
    table = {name: [*o, "parallel.pp=2", "parallel.microbatches=8"] for name, o in OPTIONS.items()}
    return {"model": MODEL, "pp": 2, "microbatches": 8, "steps": ctx.args.option_steps,
            "repeats": ctx.args.option_repeats, "limits": OPTION_LIMITS, "steady": "median step time from step 2 on",
            "runs": option_runs(ctx, table, OPTION_LIMITS, "options")}


def option_table(runs: Sequence[Mapping[str, Any]], names: Iterable[str],
                  ratio_specs: Sequence[tuple[str, str, str]]) -> tuple[list[str], dict[str, list[float]]]:
    ratios: dict[str, list[float]] = {}
    repeats = sorted({r["repeat"] for r in runs})
    for label, cfg, base in ratio_specs:
        for rep in repeats:
            a = find(runs, config=cfg, repeat=rep)
            b = find(runs, config=base, repeat=rep)
            if a and b and a.get("steady_s") and b.get("steady_s"):
                ratios.setdefault(label, []).append(a["steady_s"] / b["steady_s"])
    lines = ["| config | overrides | steady step (s) per repeat | step 0 (s) | step 1 (s) | peak memory MiB (max "
             "rank) |",
             "|---|---|---|---|---|---|"]
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        if not mine:
            continue
        ok = [r for r in mine if r.get("status") == "ok"]
        overrides = " ".join(mine[0].get("overrides", []))
        if not ok:
            lines.append(f"| {name} | `{overrides}` | failed: {mine[0].get('error', '')} | | | |")
            continue
        mem = max(max(r["peak_mem_bytes"]) for r in ok if r.get("peak_mem_bytes")) / MIB
        steady_s = ", ".join(num(r.get("steady_s")) + star(r) for r in ok)
        lines.append(f"| {name} | `{overrides}` | {steady_s} | "
                     f"{', '.join(num(r.get('first_step_s'), '.2f') for r in ok)} | "
                     f"{', '.join(num(r.get('second_step_s'), '.2f') for r in ok)} | {mem:.0f} |")
    return lines, ratios


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    table, ratios = option_table(runs, OPTIONS, OPTION_RATIOS)
    lines = ["## Training options: cost at pp=2, m=8", "", meta_line(data["meta"], runs), "",
             "Model `" + " ".join(res.get("model", [])) + f"`, {res.get('steps')} steps, profiling off; every config "
             f"once per repeat ({res.get('repeats')} repeats, order reversed on odd repeats). Steady = median step "
             "time from step 2 on; a ratio divides a config's steady step by its baseline's in the same repeat. "
             "Compiled runs start from an empty inductor cache (`TORCHINDUCTOR_CACHE_DIR` per run), so step 0 holds "
             "the whole cold compile."
             + "".join(f" `{n}`: {lim.get('steps')} steps, {lim.get('repeats')} repeat(s) only (bf16 matmuls are "
                       "several times slower than fp32 on a CPU without native bf16)."
                       for n, lim in (res.get("limits") or {}).items()),
             ""]
    notes = observations(runs, ratios, OPTION_RATIOS, (data["meta"].get("machine") or {}).get("device"))
    return lines + ratio_table(ratios, OPTION_RATIOS) + ["", *notes, "", *table, ""]


def _peak_mib(runs: Sequence[Mapping[str, Any]], config: str) -> float | None:
    peaks = [max(r["peak_mem_bytes"]) for r in runs if r["config"] == config and r.get("status") == "ok"
             and r.get("peak_mem_bytes")]
    return max(peaks) / MIB if peaks else None


def _first_steps(runs: Sequence[Mapping[str, Any]], config: str) -> list[float]:
    return [r["first_step_s"] for r in runs if r["config"] == config and r.get("first_step_s") is not None]


def _span(xs: Sequence[float]) -> str:
    return f"{min(xs):.1f}" if round(min(xs), 1) == round(max(xs), 1) else f"{min(xs):.1f}-{max(xs):.1f}"


def _why(config: str, base: str, ratio: float, device: str | None) -> str:
    """What explains a ratio, where the cause is known and the number shows it."""
    if config.endswith("+ac") and base in ("zbv", "interleaved_zb", "dualpipev") and ratio > 1.5:
        return (" With a split backward the checkpointed blocks are recomputed in I and again in W, once per "
                "parameter group (torch's weight backward runs one autograd pass per group, and non-reentrant "
                "checkpointing recomputes for each); the runner warns before such a run.")
    if config.endswith("+ac"):
        return " Checkpointing recomputes each forward once in the backward: x4/3 where a backward costs two forwards."
    if config.endswith("+bf16") and ratio > 1 and device != "cuda":
        return (" A CPU without native bf16 instructions (AVX-512 BF16, AMX) computes bf16 matmuls slower than fp32 "
                "ones: bf16 is for GPUs (`--device cuda`).")
    return ""


def observations(runs: Sequence[Mapping[str, Any]], ratios: Mapping[str, list[float]],
                 specs: Sequence[tuple[str, str, str]], device: str | None) -> list[str]:
    """Per ratio: the steady step, peak memory and (where it differs by more than twice) the first
    step against the baseline's, with the known cause where the numbers show it."""
    out = []
    for label, config, base in specs:
        if not ratios.get(label):
            continue
        ratio = statistics.median(ratios[label])
        parts = [f"steady step x{ratio:.2f}"]
        mem, mem_base = _peak_mib(runs, config), _peak_mib(runs, base)
        if mem is not None and mem_base is not None:
            parts.append(f"peak memory {mem_base:.0f} -> {mem:.0f} MiB")
        first, first_base = _first_steps(runs, config), _first_steps(runs, base)
        if first and first_base and max(first) > 2 * max(first_base):
            parts.append(f"first step {_span(first)} s against {_span(first_base)} s")
        out.append(f"- {label}: " + ", ".join(parts) + "." + _why(config, base, ratio, device))
    return out


SECTION = Section("options", options, render)
