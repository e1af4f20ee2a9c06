"""Synthesis without the barrier on the Zero Bubble paper's costs: the search scoring overlapping
steps (``plan.barrier=false``: the longest rank's span within a step, the paper's measure) on the
twelve settings of its Table 9, at twice 1F1B's memory (the paper's ZB-2p) and at 1F1B's (ZB-1p),
against the compute floor m(F+B+W), ZB-H1/ZB-H2 by the same measure and the paper's own ZB-2p and
ZB-1p steps (from its Table 5 bubble rates). No runs: simulation only, so nothing here depends on
this machine but the seconds."""

from __future__ import annotations

import time
from typing import Any, Mapping

from bench.markdown import meta_line
from bench.runs import Context
from bench.section import Page, Section
from bench.sections.zb_paper import FRACTION, TABLE5_ZB1P, TABLE5_ZB2P, TABLE9, paper_step_s


def budget_for(pp: int) -> int:
    """Orders evaluated per search: more where a simulation is cheap (p = 8, 16)."""
    return 600 if pp <= 16 else 200


def overlap_rows(settings=None, limits=("2x1f1b", "1f1b")) -> list[dict[str, Any]]:
    from runner.pipeline.simulate import rank_span, simulate, steady_step
    from runner.plan.from_costs import builtin_orders, given_problem
    from runner.plan.given import GivenCosts
    from runner.plan.synthesize import synthesize

    rows = []
    for key in settings or list(TABLE9):
        (model, p, m), (f, b, w, comm) = key, TABLE9[key]
        orders = builtin_orders(p, m)
        for limit in limits:
            given = GivenCosts("table9", p, m, [f / 1e3] * p, [b / 1e3] * p, [w / 1e3] * p, comm / 1e3, FRACTION,
                               limit, None)
            problem = given_problem(given, barrier=False)
            row: dict[str, Any] = {"model": model, "pp": p, "microbatches": m, "limit": limit,
                                   "budget": budget_for(p)}
            for name in ("zbh1", "zbh2"):
                row[f"{name}_s"] = rank_span(simulate(orders[name], problem.costs, num_stages=p, comm_s=problem.comm_s))
            t0 = time.perf_counter()
            found = synthesize(problem, seeds=orders, budget=budget_for(p), seed=0)
            assert found is not None  # 1F1B's order fits both limits
            # By the paper's measure, as its ZB-2p and the rows' ZB-H1/H2 (the search's result is the
            # finalist of the best steady step: runner.plan.synthesize.rescore; steady_s below).
            row.update(step_s=found.span_s, floor_s=found.lower_bound_s, origin=found.origin,
                       seconds=time.perf_counter() - t0,
                       steady_s=steady_step(found.order, problem.costs, num_stages=p, comm_s=problem.comm_s,
                                            steps=3)[0])
            rows.append(row)
    return rows


def zb_overlap(ctx: Context) -> dict[str, Any]:
    t0 = time.time()
    rows = overlap_rows()
    for row in rows:
        row["under_load"] = ctx.loaded(t0, time.time())
    return {"weight_grad_fraction": FRACTION, "rows": rows}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    rows = data["results"]["rows"]
    return ["## Synthesis without the barrier on the Zero Bubble paper's costs", "", meta_line(data["meta"], rows), "",
            "The search with `plan.barrier=false` (steps overlap, as with the paper's optimizer post-validation; "
            "a step is the longest rank's span, the paper's measure) on the twelve settings of the paper's Table 9 "
            f"(M_W / M_B = {data['results']['weight_grad_fraction']}), seeded with the built-in orders and round "
            "schedules (`runner.plan.rounds`), at twice 1F1B's memory (ZB-2p's) and at 1F1B's (ZB-1p's); ZB-H1 and "
            "ZB-H2 by the same measure; *floor*: m(F+B+W); *paper*: the paper's ZB-2p (2x1f1b) or ZB-1p (1f1b) "
            "step, m(F+B+W) / (1 - its Table 5 bubble rate); *from*: what the best order grew from; *s*: seconds "
            "of search (* under load).", "", *table_lines(rows), ""]


def paper_s(row: Mapping[str, Any]) -> float:
    """The paper's step for the row's setting and limit: ZB-2p at twice 1F1B's memory, ZB-1p at it."""
    key = (row["model"], row["pp"], row["microbatches"])
    return paper_step_s(key, (TABLE5_ZB2P if row["limit"] == "2x1f1b" else TABLE5_ZB1P)[key])


def _pct(x: float) -> str:
    return f"{0.0 if abs(x) < 5e-5 else x:+.2%}"  # no -0.00%


def _origin(row: Mapping[str, Any]) -> str:
    kind = row["origin"].split("(")[0]
    return kind + (" + moves" if row["origin"].endswith("+ moves") else "")


def table_lines(rows: list[Mapping[str, Any]]) -> list[str]:
    """The table and its summary, as docs/schedules.md shows them."""
    lines = ["| model | p | m | limit | floor (ms) | ZB-H1 (ms) | ZB-H2 (ms) | found (ms) | vs floor | paper (ms) | "
             "vs paper | from | budget | s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], str(r["pp"]), str(r["microbatches"]), r["limit"], f"{r['floor_s'] * 1e3:.1f}",
            f"{r['zbh1_s'] * 1e3:.1f}", f"{r['zbh2_s'] * 1e3:.1f}", f"{r['step_s'] * 1e3:.1f}",
            _pct(r["step_s"] / r["floor_s"] - 1), f"{paper_s(r) * 1e3:.1f}", _pct(r["step_s"] / paper_s(r) - 1),
            _origin(r), str(r["budget"]), f"{r['seconds']:.0f}{'*' if r.get('under_load') else ''}"]) + " |")
    two = [r for r in rows if r["limit"] == "2x1f1b"]
    near = [r for r in two if r["step_s"] <= 1.01 * paper_s(r)]
    worst = max((r["step_s"] / paper_s(r) - 1 for r in two), default=0.0)
    lines += ["", f"- At 2x1f1b: within 1% of the paper's ZB-2p in {len(near)} of {len(two)} settings "
              f"(at most {worst:+.2%})."]
    one = [r for r in rows if r["limit"] == "1f1b"]
    if one:
        h1 = sum(r["step_s"] >= r["zbh1_s"] * (1 - 1e-9) for r in one)
        lines.append(f"- At 1f1b: nothing faster than ZB-H1 in {h1} of {len(one)} settings.")
    big = [r["seconds"] for r in rows if r["pp"] == 32]
    if big:
        lines.append(f"- At p = 32 one search took {min(big):.0f}-{max(big):.0f} s.")
    return lines


SECTION = Section("zb_overlap", zb_overlap, render, ranks=lambda args: 1, times_runs=False)
