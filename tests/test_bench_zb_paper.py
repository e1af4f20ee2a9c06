"""The benchmark section on the Zero Bubble paper's costs: ZB-H2's makespan flagged where it is not
the paper's measure, and the three measures side by side with the paper's published bubble."""

import json

from bench.document import render


def _row(model: str, p: int, m: int, limit: str, makespan: float, span: float, steady: float, floor: float) -> dict:
    search = {"step_s": span, "seconds": 1.0, "origin": "zbh2", "under_load": False}
    return {"model": model, "pp": p, "microbatches": m, "limit": limit, "1f1b_s": 3.0, "zbh1_s": 2.5,
            "zbh2_s": makespan, "lower_bound_s": makespan, "seeded": search, "cold": search,
            "zbh2_span_s": span, "zbh2_steady_s": steady, "floor_s": floor}


def test_zb_paper_section_flags_the_makespan_and_shows_the_papers_measure_beside_it(tmp_path):
    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    results.mkdir()
    # 6.2B p=8 m=24 as simulated: makespan 2109.85 ms, span = steady step 2040.67 ms, floor 1898.14 ms;
    # 1.5B p=8 m=24: all three 1236.63 ms.
    rows = [_row("6.2B", 8, 24, limit, 2.10985, 2.04067, 2.04067, 1.89814) for limit in ("1f1b", "2x1f1b")]
    rows += [_row("1.5B", 8, 24, limit, 1.23663, 1.23663, 1.23663, 1.10268) for limit in ("1f1b", "2x1f1b")]
    meta = {"date": "2026-01-01 00:00", "command": "python scripts/bench.py --only zb_paper", "duration_s": 60.0,
            "waits": [], "load": {"pytest_samples": 0, "samples": 4, "foreign_cpu_share": 0.01},
            "machine": {"cpu": "test", "cores": 2, "torch": "x"}}
    payload = {"budget": 200, "weight_grad_fraction": 0.4, "rows": rows}
    (results / "zb_paper.json").write_text(json.dumps({"meta": meta, "results": payload}))
    text = render(results, out)
    assert "| ZB-H2 makespan (ms) |" in text
    assert "| 6.2B | 8 | 24 | 1f1b | 3000.00 | 2500.00 | 2109.85 † | 2109.85 |" in text
    assert "| 1.5B | 8 | 24 | 1f1b | 3000.00 | 2500.00 | 1236.63 | 1236.63 |" in text
    # One row per setting (not per limit), the paper's Table 5 figure beside ours.
    assert text.count("| 6.2B | 8 | 24 | 2109.85 † |") == 1
    assert "| 6.2B | 8 | 24 | 2109.85 † | 2040.67 | 2040.67 | 1898.14 | 0.1003 | 0.0698 | 0.0698 | 0.0698 |" in text
    assert "| 1.5B | 8 | 24 | 1236.63 | 1236.63 | 1236.63 | 1102.68 | 0.1083 | 0.1083 | 0.1083 | 0.1083 |" in text
    assert "longer than the per-stage span in 1 of 2 settings" in text
    assert "the paper's published figure to its 4 digits in 2 of 2 settings" in text
    assert "the steady step equals the per-stage span in 2 of 2 settings" in text
