import dataclasses
import json
import shutil
import sys

import pytest

from bench.cli import parse_args, ranks_needed, run_section
from bench.common import linear_fit, steady
from bench.document import render
from bench.machine import LoadMonitor
from bench.runs import Context
from bench.sections import SECTIONS
from bench.sections.planner import planner_rows, separated_pairs
from runner.models.split import build_meta_model
from runner.pipeline.schedule import (
    SCHEDULES,
    csv_order,
    default_stages_per_rank,
    read_csv_schedule,
    schedule_order,
)

from helpers.bench import write_section
from helpers.cli import run_cli
from helpers.config import ROOT, TINY, compose
from helpers.datasheet import h100_fp32_flops


def _run(monkeypatch, *args: str) -> int:
    """``runner-schedule-csv <args>`` (the console script calls this ``main``)."""
    from runner.pipeline.schedule_csv import main

    return main(list(args))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_schedule_csv_script_exports_every_schedule_as_it_runs_and_the_file_reads_back(monkeypatch, capsys,
                                                                                      tmp_path, pp, m):
    for name in SCHEDULES:
        assert _run(monkeypatch, name, "--pp", str(pp), "--microbatches", str(m)) == 0, capsys.readouterr().err
        path = tmp_path / f"{name}.csv"
        path.write_text(capsys.readouterr().out)
        order = schedule_order(name, pp, m, default_stages_per_rank(name))  # what runs (checked in test_parity)
        assert csv_order(str(path)) == order, name
        num_stages, _ = read_csv_schedule(str(path), pp=pp, stages_per_rank=None, microbatches=m)
        assert num_stages == pp * default_stages_per_rank(name)
    if pp == 2:  # the example file is this export
        assert (tmp_path / "interleaved_1f1b.csv").read_text() == (ROOT / "examples" / "interleaved_1f1b_pp2_m4.csv"
                                                                   ).read_text()


def test_schedule_csv_script_refuses_a_layout_torch_rejects(monkeypatch, capsys):
    assert _run(monkeypatch, "dualpipev", "--microbatches", "2") == 1
    assert "at least as many microbatches as stages" in capsys.readouterr().err


# scripts/bench.py (the bench package): its pure parts and its rendering only; the benchmarks themselves never
# run here.


def test_bench_fit_and_steady():
    a, b, r = linear_fit([1.0, 2.0, 3.0], [12.0, 14.0, 16.0])
    assert (round(a, 6), round(b, 6), round(r, 6)) == (10.0, 2.0, 1.0)
    assert linear_fit([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None
    assert steady([9.0, 1.0, 3.0, 2.0], skip=1) == 2.0
    assert steady([9.0], skip=1) is None


def _sweep_run(pp, schedule, m, **extra):
    return {"pp": pp, "schedule": schedule, "m": m, "status": "ok", "step_time_s": 2.0, "tokens_per_s": 4096.0,
            "bubble": 0.15, "bubble_per_rank": [0.2, 0.1], "bubble_theoretical": 0.11, "theoretical_source": "formula",
            "mean_costs_s": {"0F": 0.03, "1F": 0.031, "0B": 0.06}, "peak_mem_bytes": [500 * 2**20, 400 * 2**20],
            **extra}


def test_bench_renders_whatever_results_exist(tmp_path):
    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    text = render(results, out)
    assert "No results yet for: efficiency, scaling" in text and out.read_text() == text

    runs = [_sweep_run(2, "gpipe", 8), _sweep_run(2, "1f1b", 8), _sweep_run(2, "zbv", 8, under_load=True, rerun=True),
            {"pp": 2, "schedule": "dualpipev", "m": 8, "status": "failed", "error": "ConfigError: nope"}]
    for r in runs[:2]:
        r["under_load"] = False
    write_section(results, "efficiency", {"model": ["model.dim=8"], "steps": 5, "runs": runs})
    rows = [{"pp": 2, "m": 8, "schedule": s, "status": "ok", "step_time_s": 2.0, "peak_mem_bytes": [p, p],
             "expected_in_flight": [n, n], "expected_activation_bytes": [n * 2**20, n * 2**20]}
            for s, n, p in [("gpipe", 8, 900 * 2**20), ("1f1b", 2, 500 * 2**20), ("zbv", 4, 700 * 2**20)]]
    write_section(results, "scaling", {"rows": rows, "activation_bytes_per_sample": {"block0": 2**20}})
    opts = [{"config": c, "repeat": 0, "status": "ok", "steady_s": s, "first_step_s": s, "second_step_s": s,
             "peak_mem_bytes": [2**28]} for c, s in [("1f1b", 1.0), ("1f1b+ac", 1.3), ("zbv", 1.1)]]
    write_section(results, "options", {"model": [], "steps": 8, "repeats": 1, "runs": opts},
             load={"pytest_samples": 2, "samples": 4, "foreign_cpu_share": 0.4})
    write_section(results, "startup", {"pairs": [{"runner_s": 10.0, "bare_s": 4.0, "phases_s": None}]})
    text = render(results, out)
    assert "| 2 | gpipe | 8 | 4,096 | 2.000 | 30-31 | 0.150 | 0.20/0.10 | 0.110 f | +0.040 | 500 |" in text
    assert "failed: ConfigError: nope" in text and "| 2 | zbv* | 8 |" in text
    assert "**1 of 3 kept results ran under load** (marked *), after re-running 1 that had" in text
    assert "![measured vs theoretical bubble](benchmarks/bubble.png)" in text and (results / "bubble.png").is_file()
    assert "| activation checkpointing full / none, 1f1b | 1.300 | 1.300 |" in text
    # Observations are sentences built from the same numbers.
    assert "gpipe 0.150 vs 0.110 (+0.040); 1f1b 0.150 vs 0.110 (+0.040): 2 of 2 within 0.05." in text
    assert "- activation checkpointing full / none, 1f1b: steady step x1.30, peak memory 256 -> 256 MiB." in text
    assert "**ran under load**" in text and "No per-phase split" in text and "No config-error timings" in text
    assert "No results yet for: overhead, profiling" in text

    (results / "notes.md").write_text("## Notes\n\nWritten by hand.\n")  # not part of the document any more
    phases = {"compose_validate": 1.0, "spawn": 3.0, "init": 1.0, "build": 2.0, "first_step": 3.0}
    errors = {name: {"s": s, "returncode": code, "error": "x"} for name, s, code in
              [("misspelt key", 0.5, 1), ("unknown value", 0.7, 2), ("rejected combination", 0.6, 2)]}
    write_section(results, "startup", {"pairs": [{"runner_s": 10.0, "bare_s": 4.0, "phases_s": phases,
                                             "config_errors": errors}] * 2})
    text = render(results, out)
    assert "| spawn | 3.00 | 30% |" in text and "| total | 10.00 | |" in text
    assert "| unknown value | `train.precision=fp16` | 2 | 0.70, 0.70 | 0.70 |" in text
    assert "Written by hand" not in text and "The largest phase is `spawn`, 30% of the startup." in text


@pytest.mark.parametrize("folder, page", [("benchmarks", "BENCHMARKS.md"), ("benchmarks/cuda", "BENCHMARKS-cuda.md")])
def test_benchmarks_md_is_what_the_renderers_make_of_the_committed_json(tmp_path, folder, page):
    # Nothing in BENCHMARKS.md is written by hand: rendering benchmarks/*.json reproduces it (after
    # a run, or a change to a renderer, `python scripts/bench.py --render`); the GPU page likewise.
    results = tmp_path / folder
    results.mkdir(parents=True)
    for path in (ROOT / folder).glob("*.json"):
        shutil.copy(path, results / path.name)
    assert render(results, tmp_path / page) == (ROOT / page).read_text()


def test_the_gpu_checks_section_renders_what_the_script_left_and_runs_on_gpus_only(tmp_path, capsys):
    from bench.sections.gpu_checks import collect

    out = tmp_path / "gpu"
    (out / "runs" / "rehearse-8b-pp4" / "rehearsal").mkdir(parents=True)
    (out / "runs" / "target-8b").mkdir(parents=True)
    (out / "summary.txt").write_text("1b-bf16: exit 0 in 30 s\nrehearse-8b-pp4: exit 124 in 200 s\n")
    # Two pp=1 runs of the tiny model (its parameters counted from its config on meta), tokens/s
    # chosen for an MFU of 50% in bf16 on the H100's dense 989.5 TFLOP/s, and 50% x 989.5 / 67 in fp32
    # (67.5 under torch 2.11).
    from omegaconf import OmegaConf

    params = sum(p.numel() for p in build_meta_model(compose(*TINY).model).module.parameters())
    bf16_tokens = 0.5 * 989.5e12 / (6 * params)
    runs = [("1b-bf16", "bf16", bf16_tokens, 0.2), ("1b-fp32", "fp32", bf16_tokens / 10, 2.0)]
    for name, precision, tokens, step in runs:
        (out / "runs" / name).mkdir(parents=True)
        OmegaConf.save(compose(*TINY, f"train.precision={precision}"), out / "runs" / name / "resolved_config.yaml")
        (out / "runs" / name / "summary.json").write_text(json.dumps(
            {"tokens_per_s": tokens, "step_time_s": step, "peak_mem_bytes": [40 * 10**9]}))
    (out / "loop-1b-bf16.json").write_text(json.dumps([1.0, 0.25, 0.25, 0.26]))
    peak = {"params": 8e9, "grads": 8e9, "optimizer_state": 16e9, "activations_and_rest": 10e9, "total": 42e9}
    (out / "runs" / "rehearse-8b-pp4" / "rehearsal" / "rank0.json").write_text(
        json.dumps({"rank": 0, "peak_bytes": peak, "step_s": 0.9}))  # rank 1 never finished: no rehearsal.json
    estimate = {"params": 9e9, "grads": 9e9, "optimizer": 18e9, "activations": 6e9, "total": 42e9}
    (out / "runs" / "target-8b" / "plan.json").write_text(json.dumps([
        {"schedule": "1f1b", "pp": 4, "dp": 2, "tp": 1, "dp_mode": "ddp", "microbatches": 4, "valid": True,
         "memory_per_rank": [estimate]},
        {"schedule": "gpipe", "pp": 4, "dp": 2, "tp": 1, "dp_mode": "ddp", "microbatches": 4, "valid": False}]))
    write_section(tmp_path / "cuda", "gpu_checks", {"device_name": "NVIDIA H100 80GB HBM3", **collect(out)},
             machine={"cpu": "x", "cores": 16, "torch": "2.13", "device": "cuda", "device_name": "1 x NVIDIA H100"})
    text = render(tmp_path / "cuda", tmp_path / "BENCHMARKS-cuda.md")
    assert f"| 1b-bf16 | 0.200 | {bf16_tokens:,.0f} | 50% | 10.00 | 40.0 |" in text
    fp32_mfu = 0.05 * 989.5e12 / h100_fp32_flops()  # 74% of 2.13's 67 TFLOP/s, 73% of 2.11's 67.5
    assert f"| 1b-fp32 | 2.000 | {bf16_tokens / 10:,.0f} | {fp32_mfu:.0%} | 1.00 | 40.0 |" in text
    assert "0.250 s a step; the runner's step is 0.80x it" in text
    assert "| rehearse-8b-pp4 (partial) | 0 | 8.00 | 8.00 | 16.00 | 10.00 | 42.00 | 0.900 |" in text
    assert "rank 0: `plan.target` estimates 42.0 GB (36.0 GB of weights" in text and "rehearsed 42.0 GB (32.0" in text
    # On CPU it is skipped, and the CPU page never lists it as missing.
    ctx = Context(parse_args(["--max-wait", "0", "--results", str(tmp_path / "cpu")]), tmp_path)
    run_section("gpu_checks", ctx)
    assert "gpu_checks: skipped, it runs on a GPU only" in capsys.readouterr().out
    assert "gpu_checks" not in render(tmp_path / "empty", tmp_path / "BENCHMARKS.md")


@pytest.mark.timeout(60)
def test_the_gpu_checks_section_holds_the_fitted_times_to_the_full_length_rehearsal(tmp_path):
    """rehearse-8b-pp4-fit (times fitted through two short sequences; rank 3 by default) against the
    same rank of rehearse-8b-pp4 (finished, or cut short after it): each stage action's median over
    microbatches and its ratio; the composed step's ratio where both composed one; the fitted ranks'
    step cell is the one measured at the short length."""
    from bench.sections.gpu_checks import collect

    out, machine = tmp_path / "gpu", {"cpu": "x", "cores": 16, "torch": "2.11", "device": "cuda", "device_name": "x"}
    peak = {"params": 8e9, "grads": 8e9, "optimizer_state": 16e9, "activations_and_rest": 10e9, "total": 42e9}
    times = {"measured_at_seq_len": 128, "fit_seq_len": 64, "scaled_to_seq_len": 512, "measured_step_s": 0.31}

    def rank(r, f, b, **more):  # F and B of its stage (= r) over 3 microbatches, the middle one the median
        actions = [{"stage": r, "kind": k, "microbatch": m, "seconds": t * (1 + (m - 1) / 10)}
                   for k, t in (("F", f), ("B", b), ("I", 0.0005)) for m in range(3)]
        return {"rank": r, "peak_bytes": peak, "actions": actions, **more}

    def write(name, ranks, step=None):
        (out / "runs" / name).mkdir(parents=True, exist_ok=True)
        (out / "runs" / name / "rehearsal.json").write_text(json.dumps({"ranks": ranks, "step": step}))

    def text():
        write_section(tmp_path / "cuda", "gpu_checks", {"device_name": "NVIDIA H100 80GB HBM3", **collect(out)},
                      machine=machine)
        return render(tmp_path / "cuda", tmp_path / "BENCHMARKS-cuda.md")

    write("rehearse-8b-pp4", [rank(0, 0.5, 0.9, step_s=0.9), rank(3, 0.1, 0.2, step_s=0.9)], {"step_s": 1.0})
    write("rehearse-8b-pp4-fit", [rank(3, 0.11, 0.17, step_s=None, times=times)])
    got = text()
    assert "| rehearse-8b-pp4 | 3 | 8.00 | 8.00 | 16.00 | 10.00 | 42.00 | 0.900 |" in got
    assert "| rehearse-8b-pp4-fit | 3 | 8.00 | 8.00 | 16.00 | 10.00 | 42.00 | 0.310 at 128 tokens |" in got
    assert "*partial*" not in got and "rank 3 again" in got and "times measured at 64 and 128 tokens" in got
    assert "| 3F | 0.1000 | 0.1100 | 1.10 |" in got and "| 3B | 0.2000 | 0.1700 | 0.85 |" in got
    assert "| 3I | 0.0005 | 0.0005 |  |" in got  # under 1 ms at full length: the timer's, no ratio
    assert "0B" not in got and "| step |" not in got and "no composed step" in got
    # Every rank fitted, both steps composed: the step's ratio too.
    write("rehearse-8b-pp4-fit", [rank(0, 0.5, 0.9, times=times), rank(3, 0.11, 0.17, times=times)], {"step_s": 0.95})
    got = text()
    assert "| 0B | 0.9000 | 0.9000 | 1.00 |" in got and "| step | 1.0000 | 0.9500 | 0.95 |" in got
    # The full length cut short after rank 3 (its own file, no rehearsal.json): the actions still compare.
    (out / "runs" / "rehearse-8b-pp4" / "rehearsal.json").unlink()
    (out / "runs" / "rehearse-8b-pp4" / "rehearsal").mkdir()
    (out / "runs" / "rehearse-8b-pp4" / "rehearsal" / "rank3.json").write_text(json.dumps(rank(3, 0.1, 0.2)))
    (out / "runs" / "rehearse-8b-pp4" / "rehearsal" / "rank3-time.json").write_text("{}")  # a pass: not a rank
    got = text()
    assert "*partial*" in got and "| 3B | 0.2000 | 0.1700 | 0.85 |" in got and "| step |" not in got


@pytest.mark.multiprocess
def test_bench_script_runs_the_package_from_any_directory(tmp_path):
    # scripts/bench.py is a shim: it must find the bench package, not itself, wherever it is started
    # (checkout=False: not through PYTHONPATH).
    out = tmp_path / "B.md"
    run_cli("--render", "--results", str(tmp_path / "results"), "--output", str(out),
            program=[sys.executable, str(ROOT / "scripts" / "bench.py")], cwd=tmp_path, checkout=False, check=True)
    assert out.read_text().startswith("# Benchmarks") and "No results yet for: efficiency" in out.read_text()


def test_bench_load_monitor_flags_runs_that_overlap_other_load(monkeypatch):
    monitor = LoadMonitor()
    monkeypatch.setattr(monitor, "sample", lambda: None)
    monitor.samples = [{"t0": 0, "t": 10, "foreign": 0.0, "pytest": False},
                       {"t0": 10, "t": 20, "foreign": 0.5, "pytest": False},
                       {"t0": 20, "t": 30, "foreign": 0.0, "pytest": True},
                       {"t0": 30, "t": 40, "foreign": 0.01, "pytest": False}]
    assert monitor.loaded(1, 9) is False
    assert monitor.loaded(12, 18) is True  # other processes took half the machine
    assert monitor.loaded(21, 29) is True  # the test suite ran
    assert monitor.loaded(31, 39) is False
    assert monitor.loaded(None, 5) is None


def test_bench_holds_the_planner_to_the_measured_order_only_beyond_the_run_to_run_spread(tmp_path):
    cal = {"latency_s": 2e-4, "bandwidth": 1e9, "action_overhead_s": 5e-4, "corunning_slowdown": 1.0,
           "busy_delay_s": 2e-3, "action_jitter": 0.12}

    def round_(gpipe, zbv, dualpipev, pick="zbv/8"):  # measured step times; the predictions stay 2.0 / 1.0 / 1.5
        # Predicted: 0.1 s after the pipeline and forwards of 0.1 s; measured: 0.2 s after it, forwards of 0.12 s.
        planned = {"0F": 0.1, "0B": 0.2}
        return {"calibration": cal, "recommended": pick, "tied": [pick, "dualpipev/8"] if pick == "zbv/8" else [],
                "predicted": {"gpipe/8": {"step_s": 2.0, "bubble": 0.2, "after_s": 0.1, "costs": planned},
                              "zbv/8": {"step_s": 1.0, "bubble": 0.05, "after_s": 0.1, "costs": planned},
                              "dualpipev/8": {"step_s": 1.5, "bubble": 0.1, "after_s": 0.1, "costs": planned}},
                "measured": {"gpipe/8": {"step_s": gpipe, "bubble": 0.21, "replayed_s": gpipe * 0.9,
                                         "pipeline_s": gpipe - 0.2, "costs": {"0F": 0.12, "0B": 0.2}},
                             "zbv/8": {"step_s": zbv, "bubble": 0.06, "replayed_s": zbv, "pipeline_s": zbv - 0.2,
                                       "costs": {"0F": 0.12, "0B": 0.2}},
                             "dualpipev/8": {"step_s": dualpipev, "bubble": 0.12, "replayed_s": None}}}

    # zbv and dualpipev overlap (0.9-1.2 vs 1.1-1.3); both are clearly faster than gpipe.
    res = {"model": ["model.dim=8"], "pp": 2, "steps": 8, "microbatches": [8],
           "rounds": [round_(2.0, 1.2, 1.1), round_(2.2, 0.9, 1.3), round_(1.9, 1.0, 1.2)]}
    rows = planner_rows(res)
    gpipe = next(r for r in rows if r["schedule"] == "gpipe")
    assert (gpipe["measured_s"], gpipe["measured_min"], gpipe["measured_max"]) == (2.0, 1.9, 2.2)
    assert gpipe["replayed"] == pytest.approx(0.9)
    assert separated_pairs(rows) == (2, 2, [])
    # A prediction that puts gpipe first gets both separated pairs wrong.
    assert separated_pairs([{**gpipe, "predicted_s": 0.5}, *rows[1:]])[:2] == (0, 2)

    results = tmp_path / "benchmarks"
    write_section(results, "planner", res)
    text = render(results, tmp_path / "BENCHMARKS.md")
    assert ("message 200 us + bytes / 1.00 GB/s, +2000 us while its sender computes, runtime overhead 500 us per "
            "action, co-running compute x1.00 (action times varying by 12%)") in text
    assert "| gpipe | 8 | 2000.00 | 2000.00 | 1900.00-2200.00 | 1.000 | 0.900 | 0.200 | 0.210 |" in text
    assert ("Within 10% of the measured step: 2 of 3 (median error 0.0%, worst 25.0%, median signed +0.0%)"
            in text)
    assert "Of the 2 pairs whose measured ranges do not overlap, the prediction orders 2 the same way" in text
    assert "Fastest predicted: zbv, measured +0.0% against the measured fastest (zbv)" in text
    assert "Recommended per round: zbv/8 x3 (3 as a tie)." in text
    # Over model sizes: a summary row per size, with where the error sits.
    small = {**res, "rounds": [round_(2.0, 1.2, 1.1, "dualpipev/8"), round_(2.2, 0.9, 1.3)]}
    write_section(results, "planner", {"sizes": {"smoke": small, "benchmark": res}})
    text = render(results, tmp_path / "BENCHMARKS.md")
    assert "### smoke" in text and "### benchmark" in text
    # Medians over 2 rounds: gpipe 2.1 s and zbv 1.05 s measured (4.8% low), dualpipev 1.2 s (25% high). Pipeline
    # predicted / measured: 1.9/1.8, 0.9/1.0, 1.9/2.0, 0.9/0.7: median 1.003; the rest of the step 0.1 / 0.2;
    # forwards cost 1.2x the plan, backwards as planned.
    assert ("| smoke | `model.dim=8` | 120.00 | 2 of 3 | 4.8% | -4.8% | no probes | 1.003 | 0.500 | 1.200 | 1.000 | "
            "dualpipev/8 x1, zbv/8 x1 (1 as a tie) |") in text
    # Plans fitted to probes of zbv/8: the error without it (gpipe 0%, dualpipev +25%), the fit over rounds, and
    # each probe against the benchmark's run of zbv/8 (1.1 s against 1.2, 0.9 and 1.0 s: 8.3%, 22.2%, 10.0%).
    fits = [{"forward_scale": f, "backward_scale": 1.0, "gap_s": 5e-5, "rest_scale": 2.0,
             "probes": [{"label": "zbv m=8", "microbatches": 8, "measured_step_s": 1.1}]} for f in (1.1, 1.3, 1.2)]
    probed = {**res, "rounds": [{**r, "fit": f, "plan_s": s} for r, f, s in zip(res["rounds"], fits, (30, 42, 35))]}
    write_section(results, "planner", {"sizes": {"smoke": small, "benchmark": probed}})
    text = render(results, tmp_path / "BENCHMARKS.md")
    assert "| benchmark | `model.dim=8` | 120.00 | 2 of 3 | 0.0% | +0.0% | 12.5% |" in text
    assert ("Fitted per round to its probes (zbv m=8): forwards x1.10 to 1.30 and backwards x1.00 their timings, "
            "+50 us per action, the rest of the step x2.00. Each plan took 30-42 s, probes included.") in text
    assert "they differ by 10.0% (median over 3 pairs; 22% at most)" in text


def test_bench_device_section_renders_stage_costs_and_pp1_options_and_gpu_runs_go_elsewhere(tmp_path):
    args = parse_args(["--device", "cuda", "--pp", "2", "4"])
    assert args.results == ROOT / "benchmarks" / "cuda" and args.output == ROOT / "BENCHMARKS-cuda.md"
    assert parse_args([]).results == ROOT / "benchmarks"
    # One GPU runs the device section only; pp=4 efficiency needs 4.
    assert [ranks_needed(s, args) for s in ("device", "planner", "efficiency")] == [1, 2, 4]

    stage = {"F_s": 0.01, "B_s": 0.03, "I_s": 0.012, "W_s": 0.018, "update_s": 0.002, "saved_bytes": 3 * 2**20}
    runs = [{"config": c, "repeat": 0, "status": "ok", "steady_s": t, "first_step_s": t, "second_step_s": t,
             "overrides": ["parallel.pp=1"], "peak_mem_bytes": [m * 2**20]}
            for c, t, m in [("pp1", 1.0, 300), ("pp1+ac", 1.25, 200), ("pp1+compile", 0.8, 320)]]
    res = {"model": ["model.dim=8"], "microbatches": 8, "device_name": "1 x NVIDIA H100", "options_model": [],
           "steps": 8, "repeats": 1, "limits": {}, "runs": runs,
           "stages": [{"num_stages": 2, "stage": 0, "children": ["embed", "block0"], **stage}]}
    results = tmp_path / "cuda"
    write_section(results, "device", res, machine={"cpu": "x", "cores": 16, "torch": "2.13", "device": "cuda",
                                                "device_name": "1 x NVIDIA H100"})
    text = render(results, tmp_path / "BENCHMARKS-cuda.md")
    assert "## One device (1 x NVIDIA H100): per-stage costs and the options at pp=1" in text
    assert "| 2 | 0 | embed, block0 | 10.0 | 30.0 | 12.0 | 18.0 | 2.0 | 3.0 |" in text
    assert "| activation checkpointing full / none | 1.250 | 1.250 |" in text
    assert "| compile / eager | 0.800 | 0.800 |" in text and "| bf16 / fp32 | n/a |" in text
    assert "| pp1+ac | `parallel.pp=1` | 1.250 | 1.25 | 1.25 | 200 |" in text
    assert "1 x NVIDIA H100, NCCL." in text and "GPU runs:" not in text


def test_bench_on_one_gpu_runs_only_the_sections_whose_ranks_fit(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    ran = []
    for name in ("device", "planner"):
        fake = dataclasses.replace(SECTIONS[name], run=lambda ctx, name=name: ran.append(name) or {"ok": True})
        monkeypatch.setitem(SECTIONS, name, fake)
    args = parse_args(["--device", "cuda", "--max-wait", "0", "--results", str(tmp_path / "cuda")])
    ctx = Context(args, tmp_path)
    for section in ("planner", "device"):
        run_section(section, ctx)
    assert ran == ["device"] and "planner: skipped, it needs 2 GPUs" in capsys.readouterr().out
    saved = json.loads((tmp_path / "cuda" / "device.json").read_text())
    assert saved["meta"]["machine"]["device_name"] == "1 x Fake GPU"
    assert not (tmp_path / "cuda" / "planner.json").exists()


def test_bench_hf_section_renders_step_ratios_memory_and_weights_read_per_rank(tmp_path):
    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    mib = 2**20
    runs = [{"config": c, "repeat": r, "status": "ok", "steady_s": s * (1 + r / 10), "peak_mem_bytes": mem,
             "weights_read_bytes": read}
            for r in range(2)
            for c, s, mem, read in [("pp1", 1.0, [600 * mib], [40 * mib]),
                                    ("pp2-1f1b", 0.6, [400 * mib, 380 * mib], [22 * mib, 18 * mib])]]
    model = {"vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 8}
    write_section(results, "hf", {"model": model, "file_bytes": 40 * mib, "runs": runs})
    text = render(results, out)
    assert "40.0 MiB of fp32 weights" in text
    assert "| pp1 | 1.0500 | 1.00 | 600 | 40.0 | 1.00 |" in text
    assert "| pp2-1f1b | 0.6300 | 0.60 | 400, 380 | 22.0, 18.0 | 0.55, 0.45 |" in text


def test_bench_synthesis_section_reports_ratios_to_the_synthesized_schedule_per_round(tmp_path):
    def config(label, predicted, steps, peak=2**20):
        return {"label": label, "schedule": label.split("/")[0].split("-")[0], "overrides": [],
                "predicted_s": predicted, "peak_activation_bytes": peak,
                "runs": [{"status": "ok", "step_time_s": s, "under_load": False} for s in steps]}

    case = {"name": "heavy-last", "pp": 2, "model": ["data.vocab_size=8192"], "steps": 16, "microbatches": [4, 8],
            "configs": [config("synthesized-loop/4", 0.10, [0.11, 0.12, 0.10]),
                        config("gpipe/4", 0.12, [0.13, 0.15, 0.12]),  # slower every round
                        config("zbv/8", 0.11, [0.10, 0.13, 0.11]),  # the rounds disagree
                        config("1f1b/4", 0.09, [0.10, 0.11, 0.09])]}  # faster every round
    results = tmp_path / "benchmarks"
    write_section(results, "synthesis", {"cases": [case, {"name": "equal", "pp": 2, "error": "the plan failed"}]})
    text = render(results, tmp_path / "BENCHMARKS.md")
    assert "| gpipe/4 | 120.00 | 130.00 | 0.923 | 1.200 (1.182-1.250) | 1.200 | 1.0 |" in text
    assert ("faster than 1 of 3 built-ins in every round, slower than 1f1b/4 in every round; against the other 1 the "
            "rounds disagree") in text
    assert "### equal, pp=2" in text and "Not measured: the plan failed." in text


def _sync_run(step, overlapped, costs=None, simulated=2.0):
    """One optimizer_sync run: steady step = ``step``; simulated 2.0 s at a floor of 1.6 s."""
    return {"steady_s": step, "bubble_per_step": 0.2, "simulated_barrier_step_s": 2.3, "post_validate": None,
            "costs_s": costs, "steady": {"step_s": step, "per_rank": [0.1, 0.3], "mean": 0.2,
                                         "overlapped_steps": overlapped, "simulated_step_s": simulated,
                                         "floor_s": 1.6}}


def test_bench_optimizer_sync_section_reports_each_schedule_and_mode_against_the_simulator_and_the_paper(tmp_path):
    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    # Stages 1-3 at F = I = 100 ms, W = 50 ms: the paper's ZB-H2 bubble 3 (F + I - 2W) = 300 ms over
    # m (F + I + W) = 2000 ms plus itself, 0.130 (stage 0's, all W, not averaged in: with it, 0); with
    # W = 100 ms, 2W covers F + I: 0.
    costs = {f"{s}{k}": v for s in range(1, 4) for k, v in (("F", 0.1), ("I", 0.1), ("W", 0.05))}
    costs.update({"0F": 0.1, "0I": 0.0, "0W": 0.2})
    even = {f"{s}{k}": 0.1 for s in range(4) for k in "FIW"}
    rounds = [{"repeat": 0, "under_load": True,
               "runs": {"zbh2": {"barrier": _sync_run(2.5, 0, costs), "post_validate": _sync_run(2.4, 0, costs),
                                 "deferred": _sync_run(2.2, 3, costs)},
                        "synthesized": {"barrier": _sync_run(2.4, 0), "deferred": _sync_run(2.1, 3)}}},
              {"repeat": 1, "under_load": False,
               "runs": {"zbh2": {"barrier": _sync_run(2.0, 0, even), "post_validate": {"error": "RunnerError: x"},
                                 "deferred": _sync_run(1.9, 4, even)},
                        "synthesized": {"barrier": _sync_run(2.0, 0, simulated=1.6 - 1e-12),  # at its floor
                                        "deferred": {"error": "RunnerError: y"}}}}]
    synth = {"csv": "/tmp/w/sync-plan/s.csv", "order": "0F0,0B0\n1F0,1I0,1W0\n", "memory_limit": "2x1f1b",
             "origin": "rounds(fit the first gradient, eager W) + moves", "evaluated": 200, "seconds": 0.3,
             "weight_grad_fraction": 0.568, "costs_s": {"0F": 0.045, "1W": 0.0765},
             "peak_activation_mb": [7.568, 7.136, 5.84, 4.976], "floor_s": 2.6074,
             "spans_s": {"synthesized": 2.6074, "zbh2": 2.6189, "zbh1": 2.7821},
             "best_round": {"span_s": 2.6074, "rounds": "rounds(until the first gradient, eager W)"}}
    layout = ["schedule=zbh2", "parallel.pp=4", "parallel.microbatches=8", "train.grad_clip=0"]
    write_section(results, "optimizer_sync", {"layout": layout, "steps": 12, "rounds": rounds, "synthesized": synth})
    text = render(results, out)
    assert "## The optimizer step without the barrier" in text
    # measured 1 - 1.6 / 2.2, simulated 1 - 1.6 / 2.0, the paper's formula from the run's costs
    assert "| 0* | zbh2 | deferred | 2200 | 0.880 | 2200 | 3 | 0.200 | 2000 | 1600 | 1.10 | 0.273 | 0.200 | 0.130 |" \
        in text
    assert "| 1 | zbh2 | barrier | 2000 | 1 | 2000 | 0 | 0.200 | 2000 | 1600 | 1.00 | 0.200 | 0.200 | 0.000 |" \
        in text
    # vs the synthesized order's own barrier run; no closed form for a searched order
    row = "| 0* | synthesized | deferred | 2100 | 0.875 | 2100 | 3 | 0.200 | 2000 | 1600 | 1.05 | 0.238 | 0.200 | - |"
    assert row in text
    assert "| 1 | synthesized | barrier | 2000 | 1 | 2000 | 0 | 0.200 | 1600 | 1600 | 1.25 | 0.200 | 0.000 | - |" \
        in text  # at the floor, to rounding: 0.000, not -0.000
    assert "| 1 | zbh2 | post_validate | failed: RunnerError: x |" in text
    assert "| 1 | synthesized | deferred | failed: RunnerError: y |" in text
    assert "- zbh2 `deferred` over `barrier`, step time: 0.880, 0.950 (median 0.915)." in text
    assert "- zbh2 `post_validate` over `barrier`, step time: 0.960 (median 0.960)." in text
    assert "- synthesized `deferred` over `barrier`, step time: 0.875 (median 0.875)." in text
    assert "- synthesized over zbh2, `barrier`, step time: 0.960, 1.000 (median 0.980)." in text
    assert "- synthesized over zbh2, `deferred`, step time: 0.955 (median 0.955)." in text
    assert ("mean action times (ms: 0F 45.0, 1W 76.5), messages at 0, M_W / M_B = 0.568 (measured on the model, "
            "`runner.plan.weight_memory`), at twice 1F1B's memory (peak in microbatches' activations per rank: 7.568, "
            "7.136, 5.84, 4.976, limit 8). It grew from rounds(fit the first gradient, eager W) + moves.") in text
    assert ("2607 ms against zbh2's 2619 ms, zbh1's 2782 ms and the floor's 2607 ms; the best round schedule alone "
            "(rounds(until the first gradient, eager W)) 2607 ms. The order as run (`schedule.csv`):\n\n```\n"
            "0F0,0B0\n1F0,1I0,1W0\n```") in text

    failed = {"error": "no costs: the zbh2 barrier run failed (RunnerError: z)"}
    write_section(results, "optimizer_sync", {"layout": layout, "steps": 12, "synthesized": failed, "rounds": [
        {"repeat": 0, "under_load": False, "runs": {"zbh2": {"barrier": {"error": "RunnerError: z"}},
                                                    "synthesized": {m: {"error": "no synthesized schedule: x"}
                                                                    for m in ("barrier", "deferred")}}}]})
    text = render(results, out)
    assert "| 0 | zbh2 | deferred | failed: not run |" in text
    assert "| 0 | synthesized | barrier | failed: no synthesized schedule: x |" in text
    assert "The synthesized order: not built (no costs: the zbh2 barrier run failed (RunnerError: z))." in text


@pytest.mark.timeout(60)
def test_bench_rehearsal_section_renders_the_planners_tp_prediction_with_and_without_rehearsal(tmp_path):
    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"

    def plan(name, layout, rehearse, step, wall):
        return {"plan": name, "layout": layout, "rehearse": rehearse, "status": "ok", "step_s": step,
                "wall_s": wall, "under_load": False}

    planner = {"model": ["model.dim=32"], "layouts": {"pp2xtp2": ["parallel.pp=2", "parallel.tp=2"],
                                                      "pp4": ["parallel.pp=4"]},
               "plan_keys": ["plan.schedules=[1f1b]"], "steps": 10,
               "runs": [{"layout": "pp2xtp2", "status": "ok", "step_time_s": 0.5, "under_load": True},
                        {"layout": "pp4", "status": "ok", "step_time_s": 0.0625, "under_load": False}],
               "plans": [plan("pp2xtp2", "pp2xtp2", False, 0.024, 12.0),
                         {**plan("pp2xtp2-rehearsed", "pp2xtp2", True, 0.45, 96.0), "model_step_s": 0.06},
                         plan("pp4", "pp4", False, 0.032, 9.0)]}
    write_section(results, "rehearsal", {"overrides": [], "layouts": {}, "runs": [], "rehearsals": [],
                                    "planner": planner})
    text = render(results, out)
    assert "| pp2xtp2* | 0.500 | 0.024 | 0.05 | 0.450 | 0.90 |" in text
    assert "| pp4 | 0.062 | 0.032 | 0.51 | (0.032: not rehearsed) | 0.51 |" in text
    assert "| pp2xtp2 / pp4 | 8.00 | 0.75 | | 14.06 | |" in text
    assert ("The runs measured pp=2 x tp=2 8.00x slower than pp=4; the tp cost model plans it 1.33x faster than pp=4 "
            "(the wrong way round), the rehearsal 14.06x slower than pp=4 (the right way round). The "
            "`plan.rehearse=true` plan took 96 s") in text
    assert "by the tp cost model first: 0.060 s, 2.50x the separate plan's 0.024 s" in text
    # A plan that failed says so, and leaves its cells empty.
    planner["plans"][1] = {"plan": "pp2xtp2-rehearsed", "layout": "pp2xtp2", "rehearse": True, "status": "failed",
                           "error": "exit code 1: the rehearsal failed"}
    write_section(results, "rehearsal", {"overrides": [], "layouts": {}, "runs": [], "rehearsals": [],
                                    "planner": planner})
    text = render(results, out)
    assert "| pp2xtp2* | 0.500 | 0.024 | 0.05 |  |  |" in text
    assert "Failed: pp2xtp2-rehearsed: exit code 1: the rehearsal failed." in text and "way round" not in text


@pytest.mark.timeout(60)
def test_the_timeline_check_holds_each_recorded_action_to_the_traces_device_range_of_it(tmp_path):
    """gpu_checks.sh's timeline-cuda: timeline.json's actions (us from the first) against the torch
    trace's compute: ranges, the device's copies (gpu_user_annotation) where the trace has them, in
    order; an action timed by its launches (host durations) or placed elsewhere fails, named."""
    from bench.sections.gpu_checks import timeline_check

    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)

    def x(name, ts, dur, **more):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0, **more}

    def write(ours, device=("0F0", "0F1", "0B0", "0B1")):  # the device's ranges behind the host's launches
        (run / "timeline.json").write_text(json.dumps({"traceEvents": [
            x(f"compute:{n}", ts, dur, args={"step": 3, "kind": n[1]}) for n, ts, dur in ours]}))
        at = {"0F0": (6_000, 400), "0F1": (6_400, 400), "0B0": (6_810, 900), "0B1": (7_710, 900)}
        (run / "traces" / "rank0.json").write_text(json.dumps({"traceEvents": [
            x("compute:0F0", 5_000, 20, cat="user_annotation"), x("compute:0B0", 5_030, 30, cat="user_annotation"),
            *(x(f"compute:{n}", *at[n], cat="gpu_user_annotation") for n in device)]}))

    timed = [("0F0", 0.0, 405.0), ("0F1", 400.0, 398.0), ("0B0", 812.0, 890.0), ("0B1", 1_710.0, 905.0)]
    write(timed)
    got = timeline_check(run)
    assert got is not None and got["on"] == "device" and got["passed"] and got["actions"] == 4
    assert got["start_diff_us_max"] == pytest.approx(2.0) and got["duration_ratio"]["max"] == pytest.approx(405 / 400)
    write([("0F0", 0.0, 20.0), ("0F1", 30.0, 20.0), *timed[2:]])  # F timed by its launches (host), not the device
    got = timeline_check(run)
    assert got is not None and not got["passed"] and [r["ok"] for r in got["rows"]] == [True, True, False, False]  # B F
    assert got["kinds"] == {"B": "agrees", "F": "2 of 2 differ"}
    write([*timed[:3], ("0B1", 2_300.0, 900.0)])  # placed 590 us late: a backward, reported (the forwards decide)
    got = timeline_check(run)
    assert [(r["action"], r["ok"]) for r in got["rows"]] == [
        ("0B0", True), ("0B1", False), ("0F0", True), ("0F1", True)]
    assert got["passed"] and got["kinds"] == {"B": "1 of 2 differ", "F": "agrees"}
    # A kind the trace holds otherwise (a backward's kernels not tied to its range): reported, not compared.
    write(timed, device=("0F0", "0F1", "0B1"))
    got = timeline_check(run)
    assert got["passed"] and got["actions"] == 2 and got["kinds"] == {
        "B": "not compared: 2 recorded, 1 in the trace, not the same actions", "F": "agrees"}
    write(timed, device=("0B0", "0B1"))  # no forward to compare: not passed
    assert not timeline_check(run)["passed"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_prepared_gpu_checks_run_their_flow_on_cpu_at_toy_sizes(tmp_path):
    # The dry run a GPU host's first call depends on (docs/testing.md): the pp=1 run, the
    # hand-written loop over it, the pp=4 rehearsal, plan.target and the fitted rehearsal of rank 3,
    # then results.json as the bench section reads it.
    out = tmp_path / "gpu"
    checks = ["env", "timeline-cuda", "1b-bf16", "loop-1b-bf16", "rehearse-8b-pp4", "target-8b", "rehearse-8b-pp4-fit",
              "results"]
    done = run_cli(program=["bash", str(ROOT / "scripts" / "gpu_checks.sh")], cwd=ROOT, timeout=280,
                   env={"OUT": str(out), "GPU_CHECKS_SMALL": "1", "GPU_CHECKS_ONLY": " ".join(checks),
                        "GPU_CHECKS_PACK": "1"})
    assert done.returncode == 0, done.stderr
    # Packed for the device tool (at most 8 files back): the rest in one tarball.
    assert sorted(p.name for p in out.iterdir()) == ["gpu-checks.tar.gz", "results.json", "summary.txt"]
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == checks
    assert all(": exit 0 in " in line for line in lines), lines
    results = json.loads((out / "results.json").read_text())
    run = results["pp1"]["1b-bf16"]
    # The toy model of GPU_CHECKS_SMALL: width 64, 2 blocks, 256-token vocabulary, sequence 64.
    model = compose(*TINY, "model.dim=64", "model.n_layers=2", "model.n_heads=4", "data.vocab_size=256",
                    "train.seq_len=64").model
    assert run["params"] == sum(p.numel() for p in build_meta_model(model).module.parameters())
    assert run["precision"] == "bf16" and run["tokens_per_s"] > 0
    assert len(results["hand_loop_s"]) == 8 and all(t > 0 for t in results["hand_loop_s"])
    assert results["target"] and all(c["schedule"] == "1f1b" for c in results["target"])
    full, fitted = results["rehearsals"]["rehearse-8b-pp4"], results["rehearsals"]["rehearse-8b-pp4-fit"]
    assert [r["rank"] for r in full["ranks"]] == [0, 1, 2, 3] and full["step"]["step_s"] > 0
    (rank,) = fitted["ranks"]  # rank 3 alone: no composed step
    times = rank["times"]
    assert rank["rank"] == 3 and fitted["step"] is None and rank["seq_len"] == 32
    assert (times["fit_seq_len"], times["measured_at_seq_len"], times["scaled_to_seq_len"]) == (4, 8, 32)
    assert {f"{a['stage']}{a['kind']}" for a in rank["actions"]} == {"3F", "3B"}
    # The profiled run's timeline against its trace (on CPU its host ranges): 2 microbatches, 3 recorded steps.
    assert results["timeline"]["on"] == "host" and results["timeline"]["passed"], results["timeline"]
    assert results["timeline"]["actions"] == 12


@pytest.mark.timeout(60)
def test_bench_rehearsal_scale_renders_each_mode_over_the_full_length_per_stage_action_and_for_the_step(tmp_path):
    """The scaled times' table from fixed numbers: per stage action, the full-length rehearsal's
    composed time, then each mode's (scaled from S/n, or fitted through two short lengths) over it,
    the median over repeats; the composed step's likewise; a failed run named; a loaded run starred."""
    from bench.sections.rehearsal_scale import MODES, mode_name

    results, out = tmp_path / "benchmarks", tmp_path / "BENCHMARKS.md"
    assert [mode_name(m) for m in MODES] == ["full", "S/2", "S/4", "S/8", "fit S/8, S/4", "fit S/4, S/2"]

    def run(mode, f, b, step, repeat=0):
        return {"config": "c", "repeat": repeat, "mode": mode, "status": "ok", "step_s": step, "pipeline_s": step,
                "stage_costs_s": {"0F": f, "0B": b}, "under_load": False}

    runs = [run("full", 1.0, 2.0, 4.0), run("full", 1.2, 2.0, 4.4, repeat=1), run("full", 0.2, 2.0, 4.0, repeat=2),
            run("S/2", 1.1, 2.2, 4.4), run("S/4", 1.2, 2.6, 4.8), run("S/8", 1.4, 3.2, 5.6),
            run("fit S/8, S/4", 0.9, 2.1, 4.2),
            {"config": "c", "repeat": 0, "mode": "fit S/4, S/2", "status": "failed", "error": "exit code 1: x"}]
    payload = {"llama": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000},
               "configs": {"c": ["train.seq_len=64", "parallel.pp=1"]}, "common": ["rehearse=on"],
               "modes": [mode_name(m) for m in MODES], "runs": runs}
    write_section(results, "rehearsal_scale", payload)
    text = render(results, out)
    assert ("| config | stage action | full length (s) | S/2 / full | S/4 / full | S/8 / full | fit S/8, S/4 / full "
            "| fit S/4, S/2 / full |") in text
    assert "| c | 0B | 2.0000 | 1.10 | 1.30 | 1.60 | 1.05 |  |" in text  # the full length's median of three
    assert "| c | 0F | 1.0000 | 1.10 | 1.20 | 1.40 | 0.90 |  |" in text
    assert "| c | step | 4.0000 | 1.10 | 1.20 | 1.40 | 1.05 |  |" in text
    assert "| c | failed: fit S/4, S/2: exit code 1: x |" in text
    assert "had runs that shared the machine" not in text
    runs[4]["under_load"] = True  # one loaded run marks its configuration's rows
    runs.append({**run("full", 0.0005, 2.0, 4.0, repeat=3), "stage_costs_s": {"0I": 0.0005}})  # under 1 ms
    runs.append({**run("S/2", 0.0005, 2.0, 4.0, repeat=3), "stage_costs_s": {"0I": 0.004}})
    write_section(results, "rehearsal_scale", payload)
    text = render(results, out)
    assert "| c* | 0F | 1.0000 | 1.10 | 1.20 | 1.40 | 0.90 |  |" in text
    assert "| c* | 0I | 0.0005 |  |  |  |  |  |" in text  # the timer's noise: no ratio
    assert "Configurations marked * had runs that shared the machine with other work" in text
