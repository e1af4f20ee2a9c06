"""Pipeline efficiency: every schedule at pp 2 and 4 x m 4/8/16 on a model whose compute dominates
its messages; tokens/s, step time, the measured against the theoretical bubble, and the plot."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.common import MIB, SCHEDULES, SWEEP_MODEL, ZERO_BUBBLE, find
from bench.markdown import meta_line, num, star
from bench.runs import Context, single_pp, sweep_pp
from bench.section import Page, Section


def efficiency(ctx: Context) -> dict[str, Any]:
    """Per pp, every schedule x m: tokens/s, step time, measured and theoretical bubble, memory."""
    a = ctx.args
    rows = []
    for i, pp in enumerate(a.pp):
        if i:
            ctx.quiet(f"efficiency pp={pp}")
        started = time.time()
        sweep = [ctx.mark(r) for r in sweep_pp(ctx, pp, a.microbatches, a.steps)]
        rows += ctx.rerun_loaded(sweep, lambda r: single_pp(
            ctx, r["pp"], r["schedule"], r["m"], a.steps, ctx.work / f"rerun-pp{r['pp']}-{r['schedule']}-m{r['m']}"),
            f"efficiency pp={pp}")
        print(f"[bench] efficiency pp={pp}: {time.time() - started:.0f} s", flush=True)
    return {"model": SWEEP_MODEL, "steps": a.steps, "pp": a.pp, "microbatches": a.microbatches, "runs": rows}


def _forward_ms(run: Mapping[str, Any]) -> tuple[float, float] | None:
    fwd = [v for k, v in (run.get("mean_costs_s") or {}).items() if k.endswith("F")]
    return (min(fwd) * 1e3, max(fwd) * 1e3) if fwd else None


def _once(seen: set[str], label: str) -> str | None:
    """A legend label the first time it is asked for, then None."""
    if label in seen:
        return None
    seen.add(label)
    return label


def plot_bubbles(runs: Sequence[Mapping[str, Any]], path: Path) -> bool:
    """Measured bubble (bars) and theoretical (black ticks) per schedule and m, one panel per pp."""
    ok = [r for r in runs if r.get("status") == "ok" and r.get("bubble") is not None]
    if not ok:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pps = sorted({r["pp"] for r in ok})
    ms = sorted({r["m"] for r in ok})
    colors = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    fig, axes = plt.subplots(len(pps), 1, figsize=(11, 3.6 * len(pps)), squeeze=False)
    width = 0.8 / len(ms)
    for ax, pp in zip(axes[:, 0], pps):
        labelled: set[str] = set()
        for j, m in enumerate(ms):
            for i, name in enumerate(SCHEDULES):
                r = find(ok, pp=pp, schedule=name, m=m)
                if r is None:
                    continue
                x = i - 0.4 + width * (j + 0.5)
                ax.bar(x, r["bubble"], width=width * 0.9, color=colors[j % len(colors)],
                       label=_once(labelled, f"measured, m={m}"))
                if r.get("bubble_theoretical") is not None:
                    ax.hlines(r["bubble_theoretical"], x - width * 0.45, x + width * 0.45, colors="black",
                              linewidth=2, label=_once(labelled, "theoretical"))
        ax.set_xticks(range(len(SCHEDULES)), SCHEDULES, fontsize=8)
        ax.set_ylabel("bubble fraction")
        ax.set_title(f"pp={pp}" + (" (4 ranks on 2 cores: oversubscribed)" if pp > (os.cpu_count() or 1) else ""),
                     fontsize=10)
        ax.legend(fontsize=7, ncol=len(ms) + 1)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Measured (bars) vs theoretical (black ticks) pipeline bubble", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    lines = ["## Pipeline efficiency: measured vs theoretical bubble", "", meta_line(data["meta"], runs), "",
             "Model: transformer, `" + " ".join(res.get("model", [])) + f"`, {res.get('steps')} steps per run "
             "(one Hydra multirun per pp over schedule x m, profiling off). Bubble = 1 - (time in the stage's own "
             "compute calls) / (pipeline-step wall time), mean over ranks and steps 1 on; theoretical: the "
             "closed form for GPipe/1F1B/interleaved/looped BFS (`f`), else the simulator with the measured costs "
             "(`sim`). Step time: median after step 0. pp=4 puts 4 ranks on 2 cores, so ranks wait for a core as "
             "well as for each other (and its compute times include that wait): it is reported, but bubbles are "
             "judged at pp=2. The pipeline-step wall time is the same for every rank: from the first rank's start "
             "to the last rank's end, so a rank that returns early (the last rank of GPipe/1F1B) counts the "
             "drain as idle, as the closed forms do.", ""]
    fwd = [_forward_ms(r) for r in runs if r.get("status") == "ok"]
    fwd_pp2 = [_forward_ms(r) for r in runs if r.get("status") == "ok" and r["pp"] == 2]
    if any(fwd):
        lo = min(f[0] for f in fwd if f)
        lines += ["Measured forward time of one microbatch on one stage (`bubble.mean_costs_s`): "
                  + (f"{min(f[0] for f in fwd_pp2 if f):.0f}-{max(f[1] for f in fwd_pp2 if f):.0f} ms at pp=2, "
                     if any(fwd_pp2) else "")
                  + f"at least {lo:.0f} ms in every run (column `fwd ms`, min-max over stages); a message is one "
                  "microbatch's activations over loopback gloo (at most 1 MiB), well under a millisecond.", ""]
    if plot_bubbles(runs, page.plot_path):
        rel = os.path.relpath(page.plot_path, page.out_dir)
        lines += [f"![measured vs theoretical bubble]({rel})", ""]
    headlines = _observations(runs, res.get("steps"))
    if headlines:
        lines += headlines + [""]
    lines += ["| pp | schedule | m | tokens/s | step time (s) | fwd ms | bubble measured | per rank | theoretical | "
              "measured - theory | peak RSS MiB (max rank) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.get("status") != "ok":
            lines.append(f"| {r['pp']} | {r['schedule']}{star(r)} | {r['m']} | failed: {r.get('error', '')} "
                         "| | | | | | | |")
            continue
        f = _forward_ms(r)
        gap = (r["bubble"] - r["bubble_theoretical"]) if r.get("bubble") is not None and \
            r.get("bubble_theoretical") is not None else None
        src = {"formula": "f", "simulated with measured costs": "sim"}.get(r.get("theoretical_source"), "")
        mem = max(r["peak_mem_bytes"]) / MIB if r.get("peak_mem_bytes") else None
        lines.append(f"| {r['pp']} | {r['schedule']}{star(r)} | {r['m']} | {num(r.get('tokens_per_s'), ',.0f')} | "
                     f"{num(r.get('step_time_s'))} | {f'{f[0]:.0f}-{f[1]:.0f}' if f else ''} | "
                     f"{num(r.get('bubble'))} | {'/'.join(num(b, '.2f') for b in r.get('bubble_per_rank') or [])} | "
                     f"{num(r.get('bubble_theoretical'))} {src} | {num(gap, '+.3f')} | "
                     f"{num(mem, '.0f')} |")
    return lines + [""]


def _gap(r: Mapping[str, Any] | None) -> float | None:
    """Measured minus theoretical bubble of a run, where it has both."""
    if r is None or r.get("bubble") is None or r.get("bubble_theoretical") is None:
        return None
    return r["bubble"] - r["bubble_theoretical"]


def _observations(runs: Sequence[Mapping[str, Any]], steps: int | None) -> list[str]:
    """At pp=2, m=8: the classic schedules' bubbles against their closed forms, the zero-bubble
    schedules against 1F1B, and whose bubbles stray further from their theory."""
    out = []
    classic = {n: find(runs, pp=2, m=8, schedule=n) for n in ["gpipe", "1f1b", "interleaved_1f1b"]}
    classic = {n: r for n, r in classic.items() if _gap(r) is not None}
    if classic:
        within = sum(abs(_gap(r)) <= 0.05 for r in classic.values())
        out.append("- pp=2, m=8, measured vs theoretical bubble: "
                   + "; ".join(f"{n} {r['bubble']:.3f} vs {r['bubble_theoretical']:.3f} ({_gap(r):+.3f})"
                               for n, r in classic.items())
                   + f": {within} of {len(classic)} within 0.05.")
    base = find(runs, pp=2, m=8, schedule="1f1b")
    zb = {n: r for n in ZERO_BUBBLE if (r := find(runs, pp=2, m=8, schedule=n)) is not None}
    ratios = [f"{n} step time x{r['step_time_s'] / base['step_time_s']:.3f}, bubble {num(r.get('bubble'))} "
              f"(theory {num(r.get('bubble_theoretical'))})"
              for n, r in zb.items() if base and r.get("step_time_s") and base.get("step_time_s")]
    if ratios:
        out.append(f"- Zero-bubble schedules against 1F1B at pp=2, m=8 (1F1B: bubble {num(base.get('bubble'))}, "
                   f"{num(base.get('step_time_s'))} s/step): " + "; ".join(ratios) + "."
                   + (f" One run each, {steps - 1} steps after the first: a difference of a few percent is within "
                      "the run-to-run noise." if steps else ""))
    zb_gaps = {n: _gap(r) for n, r in zb.items() if _gap(r) is not None}
    if zb_gaps and classic:
        widest = max(zb_gaps, key=lambda n: zb_gaps[n])
        classic_gaps, gaps = [_gap(r) for r in classic.values()], list(zb_gaps.values())
        out.append(f"- Measured minus theory at pp=2, m=8: {min(gaps):+.3f} to {max(gaps):+.3f} "
                   f"for the zero-bubble schedules, {min(classic_gaps):+.3f} to {max(classic_gaps):+.3f} for the "
                   f"others; the widest, {widest}"
                   + (", has a simulated theory that overlaps F;B pairs, which a one-thread CPU rank runs one after "
                      "the other." if widest == "dualpipev" else "."))
    return out


SECTION = Section("efficiency", efficiency, render, ranks=lambda args: max(args.pp))
