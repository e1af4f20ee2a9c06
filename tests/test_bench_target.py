"""The benchmark section of target plans: published runs next to the plan's rows, the memory
estimate next to measured peaks, and the per-plan accuracy, rendered from its JSON."""

from __future__ import annotations

import json

from bench.document import render
from bench.sections.target import PUBLISHED

GIB, MIB = 2**30, 2**20


def _candidate(step: float, gib: float, **extra) -> dict:
    memory = {"params": 0, "grads": 0, "optimizer": 0, "gathered": 0, "activations": int(gib * GIB),
              "total": int(gib * GIB)}
    return {"schedule": "none", "pp": 1, "dp": 8, "dp_mode": "fsdp", "microbatches": 1, "valid": True,
            "step_time_s": step, "mfu": 0.25, "memory_per_rank": [memory], "fits_device": True, **extra}


def test_target_section_shows_published_and_planned_side_by_side(tmp_path):
    results = tmp_path / "benchmarks"
    results.mkdir()
    pub = PUBLISHED[0]  # Llama 3.1 8B on 8 H100s: 16 x 8192 tokens at 5,762 tokens/s per GPU
    header = ("target: 8 x NVIDIA H100 (torch's datasheet table, dense): 989.5 bfloat16, 989.5 float16, 67.0 float32 "
              "TFLOP/s, 3350 GB/s, 80 GiB; each op at 50% (plan.efficiency) of its roofline")
    rows = [{"published": pub["name"], "ac": "full", "returncode": 0, "header": header,
             "same_layout": _candidate(4.26, 72.2), "recommended": _candidate(4.0, 60.0, pp=2, dp=4)},
            {"published": PUBLISHED[2]["name"], "ac": "full", "returncode": 3, "error": "no candidate fits"}]
    estimate = [{"params": 100 * MIB, "grads": 100 * MIB, "optimizer": 200 * MIB, "gathered": 0,
                 "activations": 100 * MIB, "total": 500 * MIB}] * 2
    memory = {"model": ["model.dim=512"], "tiny_model": ["model.dim=32"], "baseline": [300 * MIB, 310 * MIB],
              "runs": [{"schedule": "1f1b", "measured": [850 * MIB, 760 * MIB], "estimate": estimate}]}
    figures = {"n": 10, "median": 0.082, "p90": 0.307, "signed_median": -0.01, "within_10": 6}
    probed = {"n": 4, "median": 0.106, "p90": 0.206, "signed_median": 0.01, "within_10": 2}
    every = {"n": 14, "median": 0.086, "p90": 0.273, "signed_median": -0.005, "within_10": 8}
    payload = {"published": rows, "memory": memory,
               "accuracy": {"all": {"not_probed": figures, "probed": probed, "every": every}},
               "accuracy_source": {"file": "benchmarks/planner.json", "date": "2026-11-26 20:30"}}
    meta = {"date": "2026-01-01 00:00", "command": "python scripts/bench.py", "duration_s": 60.0, "waits": [],
            "load": {}, "machine": {"cpu": "test", "cores": 2, "torch": "x"}}
    (results / "target.json").write_text(json.dumps({"meta": meta, "results": payload}))
    text = render(results, tmp_path / "BENCHMARKS.md")
    published_step = 16 * 8192 / (8 * 5762)
    # The published H100 run's device is not the planned one, and the table says so in the row itself.
    devices = ("H100 96 GB HBM2e, 2.4 TB/s, 500 W **≠ planned: NVIDIA H100 80 GiB, 3350 GB/s** (torch's table has no "
               "96 GB H100; the published 82.4 GiB would not fit the planned one)")
    assert (f"| {pub['name']} | {devices} | `train.activation_checkpointing=full` | {published_step:.2f} | 4.26 | "
            f"{4.26 / published_step:.2f} | 33-39% | 25.0% | 82.4 | 72.2 | none pp=2 dp=4 fsdp m=1: 4.00 s, 60.0 GiB |"
            in text)
    assert f"| {PUBLISHED[2]['name']} | A100 80 GB = planned: NVIDIA A100 |" in text  # no target line: the name
    assert "failed: no candidate fits" in text and f"- `{header}`" in text
    assert "| 1f1b | 0 | 500 | 100 | 850 | 550 | 1.10 |" in text
    assert "| 1f1b | 1 | 500 | 100 | 760 | 450 | 0.90 |" in text
    assert "| all | not probed | 10 | 8.2% | 30.7% | -1.0% | 6 of 10 |" in text
    assert ("All sizes, by subset: not probed (the figure the planner marks candidates with): median 8.2%, 90th "
            "percentile 30.7%; probed: median 10.6%, 90th percentile 20.6%; all plans: median 8.6%, 90th percentile "
            "27.3%. The goal (on the not-probed) is not met") in text
    assert "torchtitan `docs/performance.md` at commit eaea6f6a" in text
