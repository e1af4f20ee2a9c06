"""Plans for hardware this host does not have (``plan.target``), the whole-rank memory estimate of
every plan row, and the planner's own error: what it says about candidates closer than it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch._inductor.analysis.device_info as datasheet

from bench.accuracy import accuracy, percentile
from runner.errors import ConfigError
from runner.pipeline.schedule import V_SHAPED, schedule_order
from runner.pipeline.simulate import peak_in_flight
from runner.plan.memory import rank_memory
from runner.plan.planner import Candidate, plan
from runner.plan.report import MEASURED_ERROR, MEASURED_ERRORS, table, within_error
from runner.plan.roofline import device_peaks
from runner.plan.target import count_units, plan_target

from helpers.cli import run_cli
from helpers.config import ROOT, TINY, compose
from helpers.datasheet import h100_fp32_flops
from helpers.hf import write_model
from helpers.plan import FIXED

# The tiny Llama of helpers.hf: hidden 32, MLP 64, 4 heads of 8, 2 key/value heads, vocabulary 64.
HIDDEN, MLP, HEADS, HEAD_DIM, KV_HEADS, VOCAB = 32, 64, 4, 8, 2, 64
LAYER_PARAMS = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * MLP + 2 * HIDDEN
EMBED = HEAD = VOCAB * HIDDEN
H100 = "plan.target=NVIDIA H100"


def _target(model_dir: Path, *overrides: str):
    return compose("model=hf", f"model.path={model_dir}", f"data.vocab_size={VOCAB}", "train.seq_len=16",
                   "train.batch_size=8", H100, *overrides)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A config.json and nothing else: no weights to read."""
    directory = write_model(tmp_path_factory.mktemp("llama"), "llama", weights=False)
    assert not list(directory.glob("*.safetensors"))
    return directory


def test_target_memory_per_rank_is_parameters_gradients_adamw_and_the_schedules_activations(llama):
    cfg = _target(llama, "plan.world_size=4", "plan.microbatches=[4]")
    candidates = plan_target(cfg).candidates
    total = EMBED + 6 * LAYER_PARAMS + HIDDEN + HEAD  # embedding, 6 layers, final norm, head
    ddp = next(c for c in candidates if (c.schedule, c.pp, c.dp, c.dp_mode) == ("1f1b", 2, 2, "ddp"))
    # Every parameter lives on one pipeline rank: fp32 weights, fp32 gradients, AdamW's two moments.
    assert sum(m["params"] for m in ddp.memory_per_rank) == 4 * total
    assert sum(m["grads"] for m in ddp.memory_per_rank) == 4 * total
    assert sum(m["optimizer"] for m in ddp.memory_per_rank) == 8 * total
    assert all(m["gathered"] == 0 for m in ddp.memory_per_rank)
    # FSDP over dp=2 halves them and holds the rank's parameters gathered (fp32) and its unsharded gradients.
    fsdp = next(c for c in candidates if (c.schedule, c.pp, c.dp, c.dp_mode) == ("1f1b", 2, 2, "fsdp"))
    for sharded, whole in zip(fsdp.memory_per_rank, ddp.memory_per_rank):
        assert sharded["params"] == whole["params"] / 2 and sharded["optimizer"] == whole["optimizer"] / 2
        assert sharded["gathered"] == 2 * whole["params"]
    # Activations: 1F1B's first rank holds pp=2 microbatches of its stage at its peak.
    counts = count_units(cfg, 8 // (2 * 4), device_peaks("NVIDIA H100"))
    stage0 = list(counts)[: list(counts).index(ddp.split_points[0])]
    held = peak_in_flight(schedule_order("1f1b", 2, 4, 1), {0: 1.0, 1: 1.0})[0]
    assert held == 2
    assert ddp.memory_per_rank[0]["activations"] == 2 * sum(counts[n].saved_bytes for n in stage0)
    assert all(m["total"] == sum(v for k, v in m.items() if k != "total") for m in ddp.memory_per_rank)
    assert rank_memory(1000, 0, dp=4, dp_mode="fsdp", compute_bytes=2) == {
        "params": 1000, "grads": 1000, "optimizer": 2000, "gathered": 6000, "activations": 0, "total": 10000}


def test_target_costs_come_from_flop_counts_and_scale_with_the_model(llama, tmp_path):
    peaks = device_peaks("NVIDIA H100")
    counts = count_units(_target(llama), 2, peaks)
    tokens, seq = 2 * 16, 16
    # A layer's forward: 2 FLOPs per weight per token in its matmuls, and attention's two products.
    matmul = LAYER_PARAMS - 2 * HIDDEN
    assert counts["model.layers.0"].flops["F"] == 2 * tokens * matmul + 4 * 2 * HEADS * seq * seq * HEAD_DIM
    assert counts["model.layers.0"].flops["W"] == 2 * tokens * matmul  # a weight gradient per weight per token
    assert counts["model.layers.0"].params == LAYER_PARAMS
    deeper = write_model(tmp_path / "deeper", "llama", weights=False, num_hidden_layers=12)
    doubled = count_units(_target(deeper), 2, peaks)

    def blocks_f(c):
        return sum(u.seconds["F"] for n, u in c.items() if ".layers." in n)

    assert blocks_f(doubled) == pytest.approx(2 * blocks_f(counts))
    # Twice the layers on one stage each side: each stage's forward about twice as long.
    one = plan_target(_target(llama, "plan.world_size=2", "plan.microbatches=[4]", "train.precision=bf16"))
    two = plan_target(_target(deeper, "plan.world_size=2", "plan.microbatches=[4]", "train.precision=bf16"))
    [a] = [c for c in one.candidates if (c.schedule, c.pp) == ("gpipe", 2)]
    [b] = [c for c in two.candidates if (c.schedule, c.pp) == ("gpipe", 2)]
    assert 1.6 < b.stage_costs_s["1F"] / a.stage_costs_s["1F"] < 2.1
    # Halving the efficiency doubles every action.
    half = plan_target(_target(llama, "plan.world_size=2", "plan.microbatches=[4]", "train.precision=bf16",
                               "plan.efficiency=0.25"))
    [h] = [c for c in half.candidates if (c.schedule, c.pp) == ("gpipe", 2)]
    assert h.stage_costs_s["0F"] == pytest.approx(2 * a.stage_costs_s["0F"])


def test_target_costs_put_the_first_stages_whole_backward_in_its_weight_step(llama):
    """The first stage's input is token ids: it takes no gradient, so its input-gradient step (I)
    is empty and its weight step (W) is its whole backward, the I + W of its units' FLOP counts, as
    the runtime runs it under zero-bubble schedules (the rehearsal's scaling does the same); a later
    stage's I and W are its units' own."""
    cfg = _target(llama, "plan.world_size=2", "plan.microbatches=[4]")
    [zbh1] = [c for c in plan_target(cfg).candidates if (c.schedule, c.pp) == ("zbh1", 2)]
    counts = count_units(cfg, 8 // 4, device_peaks("NVIDIA H100"))
    names = list(counts)
    first, second = names[: names.index(zbh1.split_points[0])], names[names.index(zbh1.split_points[0]):]
    eff = cfg.plan.efficiency

    def seconds(units, kind):
        return sum(counts[n].seconds[kind] for n in units) / eff

    assert seconds(first, "I") > 0  # the first stage's layers do compute input gradients, for its embedding
    costs = zbh1.stage_costs_s
    assert costs["0I"] == 0.0
    assert costs["0W"] == pytest.approx(seconds(first, "I") + seconds(first, "W"), rel=1e-12) == costs["0B"]
    assert (costs["1I"], costs["1W"]) == pytest.approx((seconds(second, "I"), seconds(second, "W")), rel=1e-12)
    assert counts[first[0]].flops["I"] == 0  # the embedding takes token ids: no input gradient to count


def test_a_target_plan_with_the_barrier_of_a_tied_model_adds_the_sum_the_plan_without_it_counts():
    """``plan.target`` with ``model.tie_embeddings`` and the barrier: where the embedding and the
    head sit on different ranks (not V placements) the step takes the tied gradient's ring all-reduce between them after
    the pipeline (``tied_s``: 2 latencies + its fp32 bytes over the link at 2 ranks, every rank at
    pp=2: exactly that, whatever the schedule), the same seconds the plan without the barrier puts on
    a 1F1B steady step and on a commit step; one rank (pp=1) or both ends on one rank (ZBV, DualPipeV): nothing."""
    common = [*TINY, "model.dim=256", "train.seq_len=128", "plan.target=nvidia a100", "plan.world_size=2",
              "plan.microbatches=[4]", "plan.comm_latency_s=1e-4", "plan.comm_bandwidth=1e9"]

    def candidates(*more):
        return {(c.schedule, c.pp, c.dp_mode): c for c in plan_target(compose(*common, *more)).candidates if c.valid}

    untied, tied = candidates(), candidates("model.tie_embeddings=true")
    free = candidates("model.tie_embeddings=true", "plan.barrier=false")
    free_untied = candidates("plan.barrier=false")
    assert set(tied) == set(untied) == set(free)
    meet = 2 * 1e-4 + 4 * 48 * 256 / 1e9
    split = [k for k in tied if k[1] == 2 and k[0] not in V_SHAPED]
    assert {k[0] for k in split} >= {"1f1b", "zbh2"}
    for key in split:
        a, b = untied[key], tied[key]
        assert b.tied_s == pytest.approx(meet, rel=1e-9) and a.tied_s == 0.0, key
        assert b.step_time_s == pytest.approx(a.step_time_s + meet, rel=1e-9), key
        assert b.pipeline_s == a.pipeline_s and b.sync_s == a.sync_s and b.optimizer_s == a.optimizer_s
        assert free[key].commit_step_s - free_untied[key].commit_step_s == pytest.approx(meet, rel=1e-6), key
    one = ("1f1b", 2, "none")
    assert (free[one].step_time_s - free_untied[one].step_time_s) == pytest.approx(
        tied[one].step_time_s - untied[one].step_time_s, rel=1e-6)
    for key in [k for k in tied if k[1] == 1 or k[0] in V_SHAPED]:
        assert tied[key].step_time_s == untied[key].step_time_s and tied[key].tied_s == 0.0, key
    assert {"zbv", "dualpipev"} <= {k[0] for k in tied}


def test_target_plans_the_builtin_transformer_too_and_refuses_unknown_devices():
    cfg = compose(*TINY, "plan.target=nvidia a100", "plan.world_size=2", "plan.microbatches=[2,4]")
    result = plan_target(cfg)
    assert result.peaks.name == "NVIDIA A100" and result.peaks.flops["torch.float32"] == 19.5e12
    assert any(c.valid and c.pp == 2 for c in result.candidates) and any(c.recommended for c in result.candidates)
    # The H100's bf16 figure in torch's table includes 2:4 sparsity; fp32 is dense already.
    h100 = device_peaks("NVIDIA H100")
    assert h100.flops["torch.bfloat16"] == 989.5e12 and h100.flops["torch.float32"] == h100_fp32_flops()
    # torch 2.11 (the GPU image's, read on an H100) has no sparsity factor in its table, and the same
    # with-sparsity H100 figures.
    info = datasheet.lookup_device_info("NVIDIA H100")
    old_info = SimpleNamespace(tops=info.tops, dram_bw_gbs=info.dram_bw_gbs, dram_gb=info.dram_gb)
    read = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasheet, "lookup_device_info", lambda name: read.append(name) or old_info)
        assert device_peaks("NVIDIA H100").flops["torch.bfloat16"] == 989.5e12
    assert read == ["NVIDIA H100"]  # the 2.11 table was the one read (runner._torch.datasheet)
    with pytest.raises(ConfigError, match=r"plan.target='H100' is not a device.*Fix: plan.target=<one of .*'NVIDIA H1"):
        plan_target(compose(*TINY, "plan.target=H100"))
    with pytest.raises(ConfigError, match="plan.efficiency=1.5"):
        plan_target(compose(*TINY, H100, "plan.efficiency=1.5"))


def test_probed_plan_rows_carry_the_whole_rank_memory():
    cfg = compose(*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[2]", "plan.repeats=1")
    candidates, _, _, _ = plan(cfg)
    gpipe = next(c for c in candidates if c.valid and c.schedule == "gpipe")
    # The built-in transformer of TINY: 6 blocks of width 32 (MLP x4), embedding and head over 48 tokens.
    assert sum(gpipe.rank_params) == sum(p.numel() for p in _tiny_model().parameters())
    assert gpipe.rank_memory_bytes == [16 * n + a for n, a in zip(gpipe.rank_params, gpipe.peak_activation_bytes)]
    assert "rank mem (MiB)" in table(candidates)


def _tiny_model():
    from runner.models.builtin import transformer

    return transformer(vocab_size=48, max_seq_len=16, dim=32, n_layers=6, n_heads=4, ffn_mult=4)


def test_the_planner_says_which_candidates_are_within_its_measured_error():
    def candidate(name: str, step: float) -> Candidate:
        return Candidate(name, 4, 1, [], valid=True, predicted_step_time_s=step, pipeline_s=step, lower_bound_s=step)

    ranked = [candidate("1f1b", 1.00), candidate("gpipe", 1.05), candidate("zbv", 1.20)]
    [line] = within_error(ranked, error=0.082)
    assert [c.within_error for c in ranked] == [True, True, False]
    assert "2 candidates are predicted within 8.2% of the fastest" in line and "1f1b m=4" in line
    assert within_error([candidate("1f1b", 1.0), candidate("gpipe", 1.5)], error=0.082) == []
    # The stated figure is the one the script computes from the committed benchmark results.
    figures = accuracy(json.loads((ROOT / "benchmarks" / "planner.json").read_text()))["all"]
    for name, group in (("not probed", "not_probed"), ("probed", "probed"), ("all", "every")):
        assert MEASURED_ERRORS[name] == (round(figures[group]["median"], 3), round(figures[group]["p90"], 3)), name
    assert MEASURED_ERROR == MEASURED_ERRORS["not probed"]
    # The message names the subset of the figure it marks with and states all three with their 90th percentile.
    assert ("median error on a single plan of a configuration it did not probe (not probed: median 8.2%, 90th "
            "percentile 30.7%; probed: median 10.6%, 90th percentile 20.6%; all: median 8.6%, 90th percentile "
            "27.3%;") in line


def test_single_plan_accuracy_from_a_planner_json():
    def plan_round(predicted: dict, measured: dict, probed: list[str]) -> dict:
        return {"predicted": {k: {"step_s": v} for k, v in predicted.items()},
                "measured": {k: {"step_s": v} for k, v in measured.items()},
                "fit": {"probes": [{"label": p} for p in probed]}}

    data = {"results": {"sizes": {"small": {"rounds": [
        plan_round({"1f1b/2": 1.1, "gpipe/2": 0.8, "zbv/2": 1.0}, {"1f1b/2": 1.0, "gpipe/2": 1.0, "zbv/2": 2.0},
                   ["1f1b m=2"]),
        plan_round({"1f1b/2": 0.95, "gpipe/2": 1.3}, {"1f1b/2": 1.0, "gpipe/2": 1.0, "zbv/2": 1.0}, ["1f1b m=2"]),
    ]}}}}
    figures = accuracy(data)
    probed, others = figures["small"]["probed"], figures["small"]["not_probed"]
    assert probed["n"] == 2 and probed["median"] == pytest.approx(0.075)  # |+10%|, |-5%|
    assert others["n"] == 3 and others["median"] == pytest.approx(0.3)  # |-20%|, |-50%|, |+30%|
    assert others["p90"] == pytest.approx(0.46) and others["signed_median"] == pytest.approx(-0.2)
    assert figures["all"]["every"]["n"] == 5
    assert percentile([1, 2, 3, 4, 5], 0.9) == pytest.approx(4.6)


@pytest.mark.multiprocess
def test_target_plan_cli_prints_seconds_and_memory_per_rank(llama, tmp_path):
    done = run_cli("model=hf", f"model.path={llama}", f"data.vocab_size={VOCAB}", "train.seq_len=16",
                   "train.batch_size=8", "plan.target=NVIDIA H100", "plan.world_size=4", "plan.microbatches=[2,4]",
                   "hydra.run.dir=plan", module="runner.plan", cwd=tmp_path, check=True)
    assert "x NVIDIA H100" in done.stdout and "each op at 50% (plan.efficiency)" in done.stdout
    assert re.search(r"step \(s\).*memory/rank \(GiB\)", done.stdout)
    records = json.loads((tmp_path / "plan" / "plan.json").read_text())
    best = next(r for r in records if r["recommended"])
    assert best["step_time_s"] > 0 and best["memory_per_rank"][0]["total"] > 0
    [best_line] = [line for line in done.stdout.splitlines() if line.startswith(("best: ", "best (tied): "))]
    assert f"parallel.pp={best['pp']}" in best_line
    assert done.stdout.splitlines()[-2:] == [f"plan dir  {(tmp_path / 'plan').resolve()}", "files     plan.json"]
    assert not (tmp_path / "plan" / "calibration.json").exists()  # nothing ran on this host
