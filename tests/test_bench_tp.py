"""The benchmark's tensor-parallelism section: four layouts of the same 4 ranks, rendered as
ratios to pp=4 from the same run."""


from bench.cli import parse_args, ranks_needed
from bench.document import render
from bench.sections.tp import TP_RUNS

from helpers.bench import write_section

MIB = 2**20


def test_bench_tp_section_renders_ratios_to_pp4_and_needs_four_ranks(tmp_path):
    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    runs = [{"config": c, "repeat": 0, "status": "ok", "steady_s": s, "tokens_per_s": 4096 / s,
             "peak_mem_bytes": [m * MIB] * 4}
            for c, s, m in [("pp4", 1.0, 400), ("pp2-tp2", 1.25, 420), ("dp2-pp2", 1.1, 460)]]
    runs.append({"config": "tp4", "repeat": 0, "status": "failed", "error": "ConfigError: heads"})
    write_section(results, "tp", {"overrides": ["model.dim=256"], "layouts": TP_RUNS, "runs": runs})
    text = render(results, out)
    assert "## Tensor parallelism: pp x tp x dp on the same ranks" in text
    assert "| pp4 | 1.000 | 1.00 | 4096 | 1.00 | 400, 400, 400, 400 | 1.00 |" in text
    assert "| pp2-tp2 | 1.250 | 1.25 | 3277 | 0.80 | 420, 420, 420, 420 | 1.05 |" in text
    assert "| dp2-pp2 | 1.100 | 1.10 | 3724 | 0.91 | 460, 460, 460, 460 | 1.15 |" in text
    assert "| tp4 | failed: ConfigError: heads | | | | | |" in text
    assert "all-reduces its activations twice in the forward" in text
    assert ranks_needed("tp", parse_args(["--only", "tp"])) == 4  # skipped on a host with fewer GPUs


def test_bench_rehearsal_section_renders_the_composed_step_over_the_measured_one(tmp_path):
    from bench.sections.rehearsal import REHEARSAL_RUNS

    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    runs = [{"config": c, "repeat": r, "status": "ok", "steady_s": s, "pipeline_step_s": p}
            for r in range(2) for c, s, p in [("pp2", 2.0, 1.6), ("pp2-tp2", 4.0, 3.5)]]
    runs.append({"config": "dp2-pp2-fsdp", "repeat": 0, "status": "failed", "error": "RankFailedError: x"})
    rehearsals = [{"config": "pp2", "status": "ok", "step_s": 1.8, "pipeline_s": 1.2, "wall_s": 30.0,
                   "under_load": True},
                  {"config": "pp2-tp2", "status": "ok", "step_s": 2.0, "pipeline_s": 1.75, "wall_s": 41.0},
                  {"config": "dp2-pp2-fsdp", "status": "ok", "step_s": 1.0, "pipeline_s": 0.8, "wall_s": 20.0}]
    write_section(results, "rehearsal", {"overrides": ["model.dim=256"], "layouts": REHEARSAL_RUNS, "runs": runs,
                                         "rehearsals": rehearsals},
                  load={"pytest_samples": 3, "samples": 4, "foreign_cpu_share": 0.5})
    text = render(results, out)
    assert "## Rehearsal: the composed step against the real run" in text
    assert "| pp2* | 2.000 | 1.800 | 0.90 | 1.600 | 1.200 | 0.75 | 30 |" in text
    assert "| pp2-tp2 | 4.000 | 2.000 | 0.50 | 3.500 | 1.750 | 0.50 | 41 |" in text
    assert "| dp2-pp2-fsdp | failed: RankFailedError: x | | | | | | |" in text
    assert "**1 of 1 kept results ran under load** (marked *)" in text
    assert "Every run of this section shared the machine" not in text  # only where all did
    assert ranks_needed("rehearsal", parse_args(["--only", "rehearsal"])) == 4
