"""Tensor parallelism inside each stage (``parallel.tp``): pp=2 x tp=2 computes what the unsplit
model computes, for every schedule, for the built-in transformer (its own resolved) and for Hugging
Face families (transformers' plans: Llama's, and Qwen3's, whose q_norm/k_norm gradients the tp
group must sum); and every check before launch refuses what it should, naming key, value and fix.

One 4-rank spawn (module-scoped) runs every case; the references run once each, in this process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from runner.errors import ConfigError
from runner.models.split import build_meta_model
from runner.parallel.tp import model_plan, stage_plan
from runner.validate import validate

from helpers.config import EXAMPLES, TINY, compose, resolved
from helpers.hf import hf_training, write_model
from helpers.parity import CLIP, GRAD_ATOL, SCHEDULES, assert_close_at_bf16, assert_matches, reference
from helpers.ranks import run_cases
from helpers.rehearsal import held_bytes_hooks

PP2 = ["parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
TP2 = [*PP2, "parallel.tp=2"]
# The built-in transformer's cases (and their references) with 2 blocks, not TINY's 6: what is held
# here is tp inside each stage under each schedule, not depth. 5 units still give every stage of a
# V or interleaved placement (4 stages) a tp-sharded module (the embedding, a block, or the head
# beside the norm), and the 2-stage placements several units each (test_tp_stages_keep_a_sharded_module).
SHALLOW = ["model.n_layers=2"]
BUILTIN = [*TINY, *SHALLOW]
HF_FAMILIES = {"llama": SCHEDULES, "qwen3": ["1f1b", "zbv"]}
# The Hugging Face models of the spawn (and their references and rehearsal) with 2 decoder layers,
# not 6, for the same reason: 5 units still give every stage of every placement at pp=2 a module
# transformers' plan shards (test_hf_tp_stages_keep_a_sharded_module).
HF_LAYERS = 2


def _hf_base(path: Path) -> list[str]:
    return ["device=cpu", "model=hf", f"model.path={path}", "data.vocab_size=64", "train.seq_len=16",
            "train.steps=5", "profile.enabled=false", *CLIP]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {family: write_model(root / family, family, weights=True, layers=HF_LAYERS) for family in HF_FAMILIES}


@pytest.fixture(scope="module")
def tp4(models, tmp_path_factory) -> dict[str, dict]:
    """The 4-rank spawn: every schedule for the built-in transformer and Llama at pp=2 x tp=2 with
    verify, a CSV schedule, ZB-H1, activation checkpointing, bf16, and Qwen3."""
    out = tmp_path_factory.mktemp("tp4")
    cases = {f"builtin-{s}": resolved(*BUILTIN, *CLIP, *TP2, f"schedule={s}", "verify=true") for s in SCHEDULES}
    cases["builtin-csv"] = resolved(*BUILTIN, *CLIP, *TP2, "schedule=csv",
                                    f"schedule.csv={EXAMPLES / 'zero_bubble_pp2_m4.csv'}", "verify=true")
    cases["builtin-ac"] = resolved(*BUILTIN, *CLIP, *TP2, "schedule=zbv", "train.activation_checkpointing=full")
    cases["builtin-bf16"] = resolved(*BUILTIN, *CLIP, *TP2, "schedule=1f1b", "train.precision=bf16", "verify=true")
    cases["builtin-zbh1"] = resolved(*BUILTIN, *CLIP, *TP2, "schedule=zbh1", "verify=true")
    for family, schedules in HF_FAMILIES.items():
        cases.update({f"{family}-{s}": resolved(*_hf_base(models[family]), *TP2, f"schedule={s}", "verify=true")
                      for s in schedules})
    return run_cases(out, 4, cases, more_hooks=held_bytes_hooks)  # every rank's held bytes: the rehearsal's check


@pytest.fixture(scope="module")
def builtin_reference(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("tp-reference"), *PP2[1:], *SHALLOW)


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("tp-reference-bf16"), *PP2[1:], *SHALLOW,
                     "train.precision=bf16")


@pytest.fixture(scope="module")
def hf_references(models) -> dict[str, dict]:
    return {family: hf_training(compose(*_hf_base(path), *PP2), steps=5) for family, path in models.items()}


def _assert_verified(got: dict, case: str) -> None:
    report = got["summary"]["verify"]
    assert report["passed"] and report["max_abs_diff"] < GRAD_ATOL, case


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [*(f"builtin-{s}" for s in SCHEDULES), "builtin-csv", "builtin-ac", "builtin-zbh1"])
def test_every_schedule_at_pp2_tp2_matches_the_unsplit_builtin_transformer(tp4, builtin_reference, case):
    got = tp4[case]
    assert_matches(got, builtin_reference, case)
    if case != "builtin-ac":
        _assert_verified(got, case)
    assert (got["summary"]["pp"], got["summary"]["tp"]) == (2, 2), case


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [f"{family}-{s}" for family, schedules in HF_FAMILIES.items() for s in schedules])
def test_hugging_face_plans_at_pp2_tp2_match_transformers_own_training(tp4, hf_references, case):
    got = tp4[case]
    assert_matches(got, hf_references[case.split("-")[0]], case)  # every gradient: Qwen3's q_norm/k_norm too
    _assert_verified(got, case)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bf16_at_pp2_tp2_matches_the_unsplit_bf16_run(tp4, bf16_reference):
    """Autocast inside the tp shards: losses and fp32 gradients at bf16 tolerances, verify at bf16's."""
    assert_close_at_bf16(tp4["builtin-bf16"], bf16_reference, "builtin-bf16")
    assert tp4["builtin-bf16"]["summary"]["verify"]["passed"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_compile_at_pp2_tp2_matches_the_unsplit_model_cold_and_from_the_cache(tmp_path, builtin_reference,
                                                                              monkeypatch):
    """torch.compile of each unit over tp DTensors (a minute of compilation on CPU: slow tier), then
    again from the warm cache: with one cache for the host, ranks loaded each other's compiled
    units (torch keys them alike) and the second run trained other numbers."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    case = {"compile": resolved(*BUILTIN, *CLIP, *TP2, "schedule=1f1b", "train.compile=true")}
    for run in ("cold", "warm"):
        got = run_cases(tmp_path / run, 4, case, fresh=True)  # ranks that read this cache directory
        assert_matches(got["compile"], builtin_reference, f"compile ({run})")
    caches = sorted(p.name for p in (tmp_path / "inductor").iterdir())
    assert caches == [f"runner-pp2-dp1-tp2-rank{r}" for r in range(4)]


# -- the rehearsal of the same layout (docs/rehearsal.md) -------------------------------------------
@pytest.fixture(scope="module")
def llama_rehearsal(models, tmp_path_factory) -> tuple[Path, dict, object]:
    """The Llama case of the 4-rank spawn (``llama-1f1b``) rehearsed by the command line: ranks 0
    and 2, each alone (in turn, in one process), against a capacity neither fits in (100 KiB),
    with their chrome traces (profile.enabled)."""
    from helpers.cli import run_cli

    run_dir = tmp_path_factory.mktemp("llama-rehearsal") / "run"
    done = run_cli(*_hf_base(models["llama"]), *TP2, "schedule=1f1b", "rehearse=on", "rehearse.capacity=100KiB",
                   "profile.enabled=true", f"hydra.run.dir={run_dir}", cwd=run_dir.parent, timeout=300)
    assert (run_dir / "rehearsal.json").is_file(), done.stderr[-3000:]
    return run_dir, json.loads((run_dir / "rehearsal.json").read_text()), done


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_rehearsed_llama_rank_holds_what_the_real_rank_holds_and_peaks_within_10_percent(tp4, llama_rehearsal):
    """Parameters, gradients and AdamW state to the byte; the peak (activations and the rest, and
    the total), by the same tracker, within 10% of the real rank's in a steady step."""
    real = tp4["llama-1f1b"]["summary"]
    _, report, _ = llama_rehearsal
    assert [r["rank"] for r in report["ranks"]] == [0, 2]
    for r in report["ranks"]:
        assert r["held_bytes"] == real["held_bytes"][r["rank"]], r["rank"]
        got, want = r["peak_bytes"], real["tracked_peak_bytes"][r["rank"]]
        for kind in ("activations_and_rest", "total"):
            assert abs(got[kind] - want[kind]) <= 0.10 * want[kind], (r["rank"], kind, got, want)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_rehearsal_writes_each_ranks_chrome_trace_and_the_composed_timeline(llama_rehearsal):
    run_dir, report, _ = llama_rehearsal
    for r in report["ranks"]:
        assert r["trace"] == f"rehearsal/rank{r['rank']}/traces/rank{r['rank']}.json"
        events = json.loads((run_dir / r["trace"]).read_text())["traceEvents"]
        # step 1 tracked, step 2 timed (rehearse.steps=2): the actions' times come from step 2, unprofiled
        assert (r["tracked_steps"], r["timed_step"], r["profiled_step"], r["steps"]) == (1, 2, 3, 3)
        assert {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep")} == {"ProfilerStep#3"}
    assert report["timeline"] == ["rehearsal_timeline.json", "rehearsal_timeline.png"]
    events = json.loads((run_dir / "rehearsal_timeline.json").read_text())["traceEvents"]
    computes = sorted((e["pid"], e["name"]) for e in events if e["ph"] == "X")
    assert computes == sorted((s, f"compute:{s}{k}{m}") for s in (0, 1) for k in "FB" for m in range(4))
    assert max((e["ts"] + e["dur"]) / 1e6 for e in events if e["ph"] == "X") == pytest.approx(
        report["step"]["pipeline_s"])
    assert (run_dir / "rehearsal_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    step = report["step"]
    assert step["mfu"] is None and "CPU" in step["mfu_unknown"]  # no peak for a CPU


# -- the plans, in process ---------------------------------------------------------------------------
def test_each_rank_compiles_into_a_cache_of_its_own_beneath_the_users(tmp_path, monkeypatch):
    import os

    from runner._torch.dist import own_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    mine = own_compile_cache("runner-pp2-dp1-tp2-rank3")
    assert mine == str(tmp_path / "runner-pp2-dp1-tp2-rank3")
    assert own_compile_cache("runner-pp2-dp1-tp2-rank3") == mine  # a second stage of the rank: the same
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == mine


def test_the_builtin_plan_shards_every_block_and_the_vocabulary_and_keeps_norms_whole():
    meta = build_meta_model(compose(*TINY).model)
    planned = stage_plan(meta.module, model_plan(meta.module))
    assert planned["embed.tok"] == "embedding_rowwise" and planned["head"] == "colwise_gather_output"
    assert {n for n, s in planned.items() if s == "colwise"} == {f"block{i}.{m}" for i in range(6)
                                                               for m in ("attn.qkv", "ffn.up")}
    assert not any("norm" in n or n == "embed.pos" for n in planned)


@pytest.mark.parametrize("family,schedule", [(f, s) for f, schedules in HF_FAMILIES.items() for s in schedules])
def test_hf_tp_stages_keep_a_sharded_module(models, family, schedule):
    """The Hugging Face cases' 2 decoder layers (``HF_LAYERS``): every stage of every placement at
    pp=2 holds a module transformers' plan shards."""
    cfg = compose(*_hf_base(models[family]), *TP2, f"schedule={schedule}")
    meta = build_meta_model(cfg.model).module
    planned = stage_plan(meta, model_plan(meta))
    for units in validate(cfg).layout.stages:
        assert any(n == u or n.startswith(f"{u}.") for n in planned for u in units), (schedule, units)


@pytest.mark.parametrize("schedule", [*SCHEDULES, "zbh1"])
def test_tp_stages_keep_a_sharded_module(schedule):
    """The built-in cases' 2 blocks (``BUILTIN``): every stage of every placement at pp=2 holds a
    module the tp plan shards, as with TINY's 6."""
    run = validate(compose(*BUILTIN, *TP2, f"schedule={schedule}"))
    meta = build_meta_model(compose(*BUILTIN).model).module
    planned = stage_plan(meta, model_plan(meta))
    for units in run.layout.stages:
        assert any(n == u or n.startswith(f"{u}.") for n in planned for u in units), (schedule, units)


def test_qwen3s_head_norms_are_the_plans_replicated_weights_with_summed_gradients(tmp_path):
    path = write_model(tmp_path / "qwen3", "qwen3", weights=False)
    meta = build_meta_model(compose(*_hf_base(path), "model.pretrained=false").model)
    planned = stage_plan(meta.module, model_plan(meta.module))
    summed = sorted(n for n, s in planned.items() if s == "replicated_with_grad_allreduce")
    assert summed == sorted(f"model.layers.{i}.self_attn.{n}" for i in range(6) for n in ("q_norm", "k_norm"))


# -- checks before launch ----------------------------------------------------------------------------
BAD_TP = [
    (["parallel.tp=3", "model.dim=48", "model.n_heads=4"], ["parallel.tp=3 does not divide model.n_heads=4",
                                                           "Fix: parallel.tp=2 or 4"]),
    (["parallel.tp=0"], ["parallel.tp=0 must be at least 1"]),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=15"],
     ["train.seq_len=15 does not divide", "a multiple of 2"]),
    (["parallel.sequence_parallel=true"], ["parallel.sequence_parallel=true", "parallel.tp=1",
                                           "Fix: parallel.tp=2 or more"]),
    (["parallel.loss_parallel=true"], ["parallel.loss_parallel=true", "parallel.tp=1"]),
    (["parallel.tp=2", "parallel.loss_parallel=true", "+loss.label_smoothing=0.1"],
     ["parallel.loss_parallel=true", "label_smoothing=0.1", "Fix: parallel.loss_parallel=false"]),
    (["parallel.tp=2", "model=mlp", "model._target_=helpers.models.nested", "model.n_layers=4",
      "parallel.stage_modules=[[embed,layers.0,layers.1],[layers.2,layers.3,norm,head]]"],
     ["parallel.tp=2", "declares no tensor-parallel plan", "Fix: parallel.tp=1"]),
]


@pytest.mark.parametrize("overrides,expected", BAD_TP, ids=[" ".join(o) for o, _ in BAD_TP])
def test_bad_tensor_parallel_input_is_refused_before_launch(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate(compose(*TINY, *PP2, *overrides))
    for text in expected:
        assert text in str(info.value), str(info.value)


@pytest.mark.parametrize("family,tp,expected", [
    ("gpt2", 2, ["a 'gpt2' model declares no tensor-parallel plan"]),
    ("llama", 4, ["parallel.tp=4 does not divide num_key_value_heads=2 in model.path's config.json",
                  "Fix: parallel.tp=2"]),
])
def test_hugging_face_models_without_a_plan_or_with_too_few_heads_are_refused(tmp_path, family, tp, expected):
    path = write_model(tmp_path / family, family, weights=False)
    with pytest.raises(ConfigError) as info:
        validate(compose(*_hf_base(path), "model.pretrained=false", *PP2, f"parallel.tp={tp}"))
    for text in expected:
        assert text in str(info.value), str(info.value)


def test_a_plan_with_a_style_the_runner_does_not_translate_is_refused(monkeypatch):
    from runner.models import builtin as models

    monkeypatch.setattr(models, "TP_PLAN", {**models.TP_PLAN, "block*.ffn.up": "colwise_split_input"})
    with pytest.raises(ConfigError, match=r"style\(s\) \['colwise_split_input'\].*Fix: parallel.tp=1"):
        validate(compose(*TINY, *TP2))
    monkeypatch.setattr(models, "TP_PLAN", {"blocks.*.mlp": "colwise"})
    with pytest.raises(ConfigError, match=r"names none of its modules"):
        validate(compose(*TINY, *TP2))
    monkeypatch.setattr(models, "TP_PLAN", {"embed.tok": "embedding_rowwise", "head": "rowwise"})
    with pytest.raises(ConfigError, match=r"the tied weight \['embed.tok.weight', 'head.weight'\] would be sharded "
                                          r"differently in embed.tok \(embedding_rowwise\), head \(rowwise\)"):
        validate(compose(*TINY, *TP2, "model.tie_embeddings=true"))


def test_the_degrees_multiply_into_the_world_size_with_tp_innermost():
    resolved = validate(compose(*TINY, *TP2, "parallel.dp=2", "parallel.dp_mode=fsdp", "train.batch_size=16"))
    dims = resolved.dims
    assert dims.world_size == 8 and dims.stage_ranks == 4
    assert dims.ranks_of("tp", 5) == [4, 5] and dims.ranks_of("dp", 5) == [5, 7] and dims.ranks_of("pp", 5) == [1, 5]
    assert torch.Size([dims.pp, dims.dp, dims.tp]) == torch.Size([2, 2, 2])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_command_line_trains_a_hugging_face_model_at_pp2_tp2_with_zbv_and_verify(tmp_path):
    """The issue's command, as a user types it: 4 ranks, verify passes, and the tensor-parallel
    all-reduces are in every rank's trace."""
    import json

    from helpers.cli import run_cli

    llama = write_model(tmp_path / "llama", "llama", weights=True)  # 6 layers: each of the 4 stages runs some
    done = run_cli("model=hf", f"model.path={llama}", "parallel.pp=2", "parallel.tp=2", "schedule=zbv",
                   "verify=true", "train.steps=2", "train.seq_len=16", "data.vocab_size=64", "profile.enabled=true",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["pp"], summary["tp"], summary["steps"]) == (2, 2, 2) and summary["verify"]["passed"]
    assert "tp=2" in done.stdout
    for rank in range(4):
        trace = json.loads((tmp_path / "run" / "traces" / f"rank{rank}.json").read_text())
        assert sum(e.get("name") == "gloo:all_reduce" for e in trace["traceEvents"]) >= 2 * 6, rank  # 2 per layer
    # The merged timeline's tp lane: each collective issued inside an action of its rank (the two
    # clocks agree), and every action of one stage and kind issuing as many (each microbatch and
    # step alike). An input backward's may end outside it: the gradient is waited for when sent.
    timeline = [e for e in json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
                if e["ph"] == "X"]
    compute = [e for e in timeline if e["tid"] == 0]
    per_action: dict[tuple, list[int]] = {}
    for a in compute:
        issued = [c for c in timeline if c["tid"] == 2 and c["pid"] == a["pid"] and 0 <= c["ts"] - a["ts"] <= a["dur"]]
        per_action.setdefault((a["args"]["stage"], a["args"]["kind"]), []).append(len(issued))
    # Outside the actions: only step 1's shape inference, a forward of each stage before its first action.
    first = {pid: min(a["ts"] for a in compute if a["pid"] == pid) for pid in (0, 1)}
    outside = [c for c in timeline if c["tid"] == 2 and not any(a["pid"] == c["pid"] and 0 <= c["ts"] - a["ts"]
                                                                 <= a["dur"] for a in compute)]
    assert all(c["ts"] < first[c["pid"]] for c in outside)
    assert sum(map(sum, per_action.values())) + len(outside) == sum(e["tid"] == 2 for e in timeline)
    assert all(len(set(counts)) == 1 for counts in per_action.values()), per_action
    assert all(per_action[(stage, "F")][0] > 0 for stage in range(4))  # every stage's forward runs tp layers


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_rehearsal_of_pp2_tp2_composes_the_simulated_step_and_exits_3_over_the_capacity(llama_rehearsal):
    """``rehearse=on`` for the llama-1f1b case: one rank per pipeline rank, each alone at world size
    4 over the rehearsal group; the composed step is the simulator's replay of its costs, and 100 KiB
    is too little: exit 3 after the table and the file, naming each rank, its peak, the capacity and a fix."""
    from runner.pipeline.schedule import schedule_order
    from runner.pipeline.simulate import simulate

    _, report, done = llama_rehearsal
    assert done.returncode == 3, done.stderr[-3000:]
    assert [r["rank"] for r in report["ranks"]] == [0, 2]  # pp 0 and pp 1, each at dp=0, tp=0
    for r in report["ranks"]:
        assert all(v > 0 for v in r["peak_bytes"].values()), r["peak_bytes"]
        assert {(a["stage"], a["kind"]) for a in r["actions"]} == {(r["coords"]["pp"], "F"), (r["coords"]["pp"], "B")}
        assert r["collectives"]["tp"]["all_reduce"]["count"] > 0 and all(math.isfinite(x) for x in r["losses"])
    step = report["step"]
    costs = {(int(k[:-1]), k[-1]): v for k, v in step["stage_costs_s"].items()}
    timeline = simulate(schedule_order("1f1b", 2, 4, 1), costs, num_stages=2, comm_s=step["message_s"])
    assert step["pipeline_s"] == pytest.approx(max(a.end for a in timeline)) and step["pipeline_s"] > 0
    assert step["step_s"] == pytest.approx(step["pipeline_s"] + step["collectives_s"] + step["optimizer_s"])
    assert 0 < step["bubble"] < 1
    assert report["fits"] is False and len(report["memory"]) == 2
    for line, r in zip(report["memory"], report["ranks"]):  # each rank, its peak, the capacity and a fix
        peak = r["peak_bytes"]["total"]
        assert line == (f"rank {r['rank']} needs {(peak - 102400) / 2**20:.2f} MiB more: its peak is "
                        f"{peak / 2**20:.2f} MiB, the capacity 0.10 MiB (rehearse.capacity). Fix: try more "
                        "parallel.pp, more parallel.tp, train.activation_checkpointing=full, fewer microbatches "
                        "in flight (a smaller train.batch_size)")
        assert line in done.stdout and line in done.stderr  # the table's verdict, and the error's
    assert "does not fit rehearse.capacity: rank 0 needs" in done.stderr
    assert "composed step" in done.stdout and "assumed: tp shards and dp replicas" in done.stdout
