"""Bad input is rejected in the launching process, before any rank starts, with a message that
names the key, the value and the fix. Everything here runs in-process in milliseconds."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from runner.errors import ConfigError
from runner.parallel.dims import ParallelDims
from runner.validate import validate

from helpers.config import EXAMPLES, ROOT, TINY, compose

PP2 = [*TINY, "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
PP1 = [*TINY, "parallel.pp=1", "train.batch_size=8"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
                                      "interleaved_zb", "zbv", "dualpipev", "zbh1", "zbh2"])
@pytest.mark.parametrize("model", ["transformer", "mlp"])
def test_every_schedule_and_model_composes_and_validates(schedule, model):
    layout = validate(compose(*PP2, f"schedule={schedule}", f"model={model}")).layout
    assert layout.pp == 2 and layout.microbatches == 4
    single = schedule in ("gpipe", "1f1b", "zbh1", "zbh2")
    assert layout.num_stages == (2 if single else 4)
    children = [n for names in layout.stages for n in names]
    assert children == ["embed", *[f"block{i}" for i in range(6)], "norm", "head"]


def test_v_schedules_fold_stages_back_onto_rank_0():
    layout = validate(compose(*PP2, "schedule=zbv")).layout
    assert layout.stage_to_rank == {0: 0, 1: 1, 2: 1, 3: 0}
    assert validate(compose(*PP2, "schedule=interleaved_1f1b")).layout.stage_to_rank == {0: 0, 1: 1, 2: 0, 3: 1}


def test_smoke_experiment_and_text_data_compose(tmp_path):
    assert validate(compose("experiment=smoke")).layout.num_stages == 2
    text = tmp_path / "corpus.txt"
    text.write_text("pipeline parallelism " * 100)
    cfg = compose("data=text", f"data.path={text}")
    assert cfg.model.vocab_size == 256
    validate(cfg)


@pytest.mark.parametrize("override", ["trian.steps=5", "train.steps=abc", "parallel.pp=two",
                                      "schedule.csv=x.csv", "model.dimm=3"])
def test_typos_and_wrong_types_fail_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        compose(override)


@pytest.mark.parametrize("override,nearest", [("trian.steps=5", "train.steps=5"), ("train.stpes=5", "train.steps=5"),
                                              ("model.dimm=3", "model.dim=3"),
                                              ("parallel.microbtches=8", "parallel.microbatches=8")])
def test_a_misspelt_key_gets_the_nearest_keys_in_the_first_message(override, nearest):
    from runner.exits import outcome

    with pytest.raises(ConfigCompositionException) as info:
        compose(override)
    code, message = outcome(info.value, started=False)
    key = nearest.split("=")[0]
    assert code == 2 and f"Did you mean {key}" in message and f"Fix: {nearest}" in message
    assert f"+{override}" not in message  # not Hydra's advice to add it, which the runner refuses next


def test_a_key_of_another_option_of_its_group_is_not_offered_as_its_own_fix():
    """model.dim is the built-in models' key, not model=hf's: the message offered "Did you mean
    model.dim? Fix: model.dim=32", the override refused."""
    from runner.exits import outcome

    with pytest.raises(ConfigCompositionException) as info:
        compose("model=hf", "model.path=/nowhere", "model.dim=32")
    code, message = outcome(info.value, started=False)
    assert code == 2 and "model.dim is a key of other model options, not of the one this run selects" in message
    assert "Fix: leave model.dim=32 out, or select a model option that has it." in message
    assert "Did you mean" not in message


# (a mistyped option or value: the last line of its message, the fix)
FIXES = {
    "schedule=zbvv": "schedule=zbvv is not an option of schedule. Did you mean schedule=zbv",
    "experiment=smok": "Did you mean experiment=smoke or experiment=smoke_dp or experiment=smoke_zbv? "
                       "Fix: experiment=smoke",
    "hydra/launcher=joblibb": "Fix: hydra/launcher=joblib",
    "schedule=xyzzy": "schedule=xyzzy is not an option of schedule. Fix: one of schedule=1f1b, schedule=csv,",
    "parallel.pp=two": "parallel.pp=two: parallel.pp takes an integer. Fix: parallel.pp=<an integer>",
    "train.lr=fast": "train.lr takes a number. Fix: train.lr=<a number>",
    "verify=maybe": "verify takes true or false. Fix: verify=true",
    "parallel.split_points=block3": "parallel.split_points takes a list. Fix: parallel.split_points=[block3]",
}


@pytest.mark.parametrize("override", list(FIXES))
def test_an_unknown_option_or_a_value_of_the_wrong_type_gets_the_fix_in_the_first_message(override):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    from runner.exits import outcome

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        with pytest.raises(HydraException) as info:  # Hydra's own message first, as the command line's
            hydra_compose("config", overrides=[override], return_hydra_config=True)
    code, message = outcome(info.value, started=False)
    assert code == 2 and FIXES[override] in message.splitlines()[-1], message


BAD = [
    # (overrides, substrings the message must contain)
    (["schedule=csv"], ["schedule.csv", "missing"]),
    (["schedule.name=zigzag"], ["schedule.name='zigzag'", "gpipe", "dualpipev", "csv"]),
    (["schedule=1f1b", "parallel.pp=4", "parallel.microbatches=2"], ["Schedule1F1B", "parallel.microbatches=2"]),
    (["schedule=dualpipev", "parallel.microbatches=2"], ["DualPipeV", "parallel.microbatches=2"]),
    (["train.batch_size=10"], ["train.batch_size=10", "multiple of 4"]),
    (["train.batch_size=2"], ["train.batch_size=2", "parallel.microbatches"]),
    (["schedule=zbv", "parallel.stages_per_rank=3"], ["ZBV", "parallel.stages_per_rank=3"]),
    (["schedule=interleaved_1f1b", "parallel.stages_per_rank=1"], ["at least 2 stages", "parallel.stages_per_rank=1"]),
    (["schedule=gpipe", "parallel.stages_per_rank=2"], ["one stage per rank", "parallel.stages_per_rank=2"]),
    (["parallel.split_points=[block9]"], ["parallel.split_points", "block9"]),
    (["schedule=interleaved_1f1b", "parallel.split_points=[block4,block2,block5]"], ["out of order"]),
    (["parallel.split_points=[block1,block3]"], ["3 stages", "has 2"]),
    (["parallel.split_points=[embed]"], ["out of order or start the first stage"]),
    (["schedule=interleaved_1f1b", "parallel.pp=4", "model.n_layers=1", "parallel.microbatches=8",
      "train.batch_size=8"], ["4 pipeline units", "8 stages"]),
    (["parallel.dp=2"], ["parallel.dp=2", "parallel.dp_mode=ddp"]),
    (["parallel.dp_mode=zero3"], ["parallel.dp_mode='zero3'"]),
    (["parallel.microbatches=0"], ["parallel.microbatches=0"]),
    (["device=tpu"], ["device='tpu'"]),
    (["model._target_=helpers.models.not_sequential"], ["Linear, not an nn.Sequential", "parallel.stage_modules="]),
    (["parallel.stage_modules=[[embed,block0],[block1]]"], ["parallel.stage_modules", "every unit exactly once",
                                                             "embed, block0 … block5, norm, head"]),
    (["parallel.stage_modules=[[embed,block0,block1,block2,block3,block4,block5,norm,head]]"],
     ["lists 1 stages but the layout has 2"]),
    (["model._target_=nowhere.factory"], ["model._target_='nowhere.factory'"]),
    (["model=mlp", "model._target_=helpers.models.mismatched_mlp"], ["'block0' (stage 0)", "(2, 16, 64)"]),
    (["data=text", "data.vocab_size=256", "data.path=/no/such/file.txt"], ["data.path='/no/such/file.txt'"]),
    (["train.precision=fp16"], ["train.precision='fp16'", "fp32, bf16"]),
    (["train.activation_checkpointing=some"], ["train.activation_checkpointing='some'", "every_n"]),
    (["train.ac_every=0"], ["train.ac_every=0"]),
    (["train.lr_schedule=step"], ["train.lr_schedule='step'", "cosine"]),
    (["train.optimizer_sync=async"], ["train.optimizer_sync='async'", "barrier, post_validate, deferred"]),
    (["train.no_decay=[bias,gain]"], ["train.no_decay", "'gain'", "embedding"]),
    (["eval.steps=0"], ["eval.steps=0"]),
    (["launch.start_method=forkserver"], ["launch.start_method='forkserver'", "auto, fork, spawn"]),
    (["loss._target_=helpers.models.per_token_loss"],
     ["loss._target_='helpers.models.per_token_loss'", "not a scalar"]),
    (["loss._target_=nowhere.loss"], ["loss._target_='nowhere.loss'", "loss(logits, targets)"]),
    (["data._target_=helpers.models.ShortBatches"],
     ["data._target_='helpers.models.ShortBatches'", "(8, 15)", "(8, 16)"]),
    # '+' forces a key into a schema-backed group: refused like a plain typo (Hydra suggests the '+').
    (["+parallel.microbtches=8"], ["parallel.microbtches", "Did you mean parallel.microbatches?"]),
    (["+checkpoint.evry=2"], ["checkpoint.evry", "Did you mean checkpoint.every?"]),
    (["+verbose=true"], ["verbose is not a key of the config"]),
    (["launch.timeout_s=0"], ["launch.timeout_s=0", "> 0"]),
    (["launch.timeout_s=-1"], ["launch.timeout_s=-1"]),
    (["launch.grace_s=-1"], ["launch.grace_s=-1", ">= 0"]),
    (["plan.probe_seconds=-1"], ["plan.probe_seconds=-1", ">= 0", "0 to plan without probes"]),
    (["verify_steps=0"], ["verify_steps=0 must be at least 1"]),
    # ZB-H1 and ZB-H2 by name (runner/pipeline/zb_orders.py): one stage per rank, enough microbatches, eager.
    (["schedule=zbh1", "parallel.stages_per_rank=2"],
     ["schedule=zbh1 runs one stage per rank", "parallel.stages_per_rank=2", "Fix: parallel.stages_per_rank=1"]),
    (["schedule=zbh2", "parallel.pp=4", "parallel.microbatches=4", "train.batch_size=8"],
     ["schedule=zbh2 needs at least 7 microbatches at parallel.pp=4", "parallel.microbatches=4",
      "Fix: parallel.microbatches=7 or more", "or schedule=zbh1 (needs 4)"]),
    (["schedule=zbh2", "parallel.microbatches=2", "train.batch_size=8"],
     ["schedule=zbh2 needs at least 3 microbatches at parallel.pp=2", "or schedule=zbh1 (needs 2)"]),
    (["schedule=zbh1", "parallel.pp=4", "parallel.microbatches=2", "train.batch_size=8"],
     ["schedule=zbh1 needs at least 4 microbatches at parallel.pp=4", "parallel.microbatches=2"]),
    (["schedule=zbh2", "train.compile=true"], ["train.compile=true with schedule=zbh2", "I/W actions split backward",
                                               "Fix: train.compile=false"]),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_rejected_with_key_value_and_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate(compose(*PP2, *overrides))
    for text in expected:
        assert text in str(info.value), str(info.value)


@pytest.mark.parametrize("data", ["data=hf", "data=text"])
def test_a_tokenizer_that_cannot_be_read_is_named_not_the_vocabulary_it_leaves_unknown(data):
    from runner.validate import check_config

    cfg = compose(data, f"data.path={EXAMPLES / 'example_corpus.txt'}", "data.tokenizer=/no/such/tokenizer")
    with pytest.raises(ConfigError, match=r"^data.tokenizer='/no/such/tokenizer': no such directory. Fix: a local "
                                          r"tokenizer directory"):
        check_config(cfg)  # the command line's first check, before torch is imported


def test_validation_resolves_one_frozen_plan_and_leaves_the_config_as_composed(tmp_path):
    cfg = compose(*TINY, "device=auto", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp",
                  "parallel.microbatches=4", "train.batch_size=16")
    composed = OmegaConf.to_yaml(cfg)
    resolved = validate(cfg, tmp_path)
    assert resolved.device == ("cuda" if torch.cuda.device_count() >= 4 else "cpu")  # auto, resolved for this host
    assert resolved.world_size == 4 and resolved.layout.microbatches == 4 and resolved.microbatch_size == 2
    assert resolved.dims == ParallelDims(pp=2, dp=2, dp_mode="ddp") and (resolved.dp, resolved.dp_mode) == (2, "ddp")
    assert resolved.threads_per_rank >= 1 and resolved.run_dir == tmp_path and resolved.resume is None
    assert OmegaConf.to_yaml(cfg) == composed  # device: auto, launch.threads_per_rank: null
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.device = "cuda"


def test_ranks_are_pinned_to_cores_of_their_own_where_they_fill_the_cores(monkeypatch):
    import runner.ranks.host as host

    monkeypatch.setattr(host, "usable_cpus", lambda: [2, 3, 5, 7])  # as `taskset -c 2,3,5,7` leaves it
    monkeypatch.setattr(host, "overloaded", lambda: None)  # an overloaded host gets one thread per rank
    for key in ("LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):  # not under torchrun
        monkeypatch.delenv(key, raising=False)
    assert validate(compose(*PP2)).rank_cpus == ((2, 3), (5, 7))  # 2 threads each, by default
    assert validate(compose(*PP2, "launch.threads_per_rank=1")).rank_cpus is None  # cores left: not unasked
    assert validate(compose(*PP2, "launch.threads_per_rank=1", "launch.pin_cpus=true")).rank_cpus == ((2,), (3,))
    assert validate(compose(*PP2, "launch.pin_cpus=false")).rank_cpus is None
    assert validate(compose(*PP2, "parallel.pp=1")).rank_cpus is None  # one rank: nothing to keep apart
    with pytest.raises(ConfigError, match=r"launch.pin_cpus=true: 2 ranks x 3 threads .* need 6 cores, and this "
                                          r"process may use 4. Fix: a smaller launch.threads_per_rank"):
        validate(compose(*PP2, "launch.threads_per_rank=3", "launch.pin_cpus=true"))
    with monkeypatch.context() as torchrun:  # torchrun (or SLURM) started the ranks: it places them
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
            torchrun.setenv(key, value)
        assert validate(compose(*PP2)).rank_cpus is None
        with pytest.raises(ConfigError, match="launch.pin_cpus=true pins the ranks the runner starts itself.*Fix: "):
            validate(compose(*PP2, "launch.pin_cpus=true"))
    resolved = validate(compose(*PP2)).resolved_values()
    assert resolved["launch.pin_cpus"] is True and resolved["launch.threads_per_rank"] == 2


@pytest.mark.timeout(30)
def test_rank_threads_wait_passively_unless_the_users_environment_says_how(monkeypatch, capsys):
    import runner.__main__ as entry
    from runner.ranks.host import passive_threads

    env: dict[str, str] = {}
    assert passive_threads(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for key, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "200")):
        env = {key: value}  # the user's own choice, GNU's or Intel's: left as it is, nothing added
        assert not passive_threads(env) and env == {key: value}
    # The command line sets it first thing (before torch loads OpenMP), in the environment its ranks inherit.
    monkeypatch.setattr("sys.argv", ["runner", "--version"])
    for user in (None, "ACTIVE"):
        monkeypatch.setenv("OMP_WAIT_POLICY", "x")  # recorded, so that the test's end restores the original
        if user is None:
            monkeypatch.delenv("OMP_WAIT_POLICY")
        else:
            monkeypatch.setenv("OMP_WAIT_POLICY", user)
        entry.cli()
        assert os.environ["OMP_WAIT_POLICY"] == (user or "PASSIVE")
    assert "runner" in capsys.readouterr().out


def test_an_overloaded_host_is_said_once_and_keeps_its_thread_count(monkeypatch):
    import runner.ranks.host as host

    monkeypatch.setattr(host, "_overload_said", [False])
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.setattr(host, "usable_cpus", lambda: [0, 1, 2, 3])
    said: list[str] = []
    monkeypatch.setattr(host, "_load_average", lambda: 4.0)  # the cores busy, nothing waiting
    assert not host.say_if_overloaded(said.append)
    assert validate(compose(*PP2)).threads_per_rank == 2 and validate(compose(*PP1)).threads_per_rank == 4
    monkeypatch.setattr(host, "_load_average", lambda: 8.5)  # other work waits for the cores
    assert host.say_if_overloaded(said.append) and not host.say_if_overloaded(said.append)  # once per process
    assert said == ["this host is overloaded: load average 8.5 on 4 cores (other work is waiting for them); steps "
                    "will be slower than on an idle host (launch.threads_per_rank=1 may help where each rank has "
                    "several threads)."]
    assert validate(compose(*PP1)).threads_per_rank == 4  # the same numbers as on an idle host
    assert validate(compose(*PP1, "launch.threads_per_rank=3")).threads_per_rank == 3  # the user's choice wins


def test_extra_keys_are_accepted_where_a_factory_takes_them():
    # A user's (or the built-in) loss/model/data factory is called with its group's keys.
    cfg = compose(*PP2, "+loss.label_smoothing=0.1")
    validate(cfg)
    assert cfg.loss.label_smoothing == 0.1


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
def test_compile_is_refused_for_split_backward_schedules_with_torchs_reason(schedule):
    with pytest.raises(ConfigError) as info:
        validate(compose(*PP2, f"schedule={schedule}", "train.compile=true"))
    message = str(info.value)
    assert "train.compile=true" in message
    assert "not supported with stage modules that have used torch.compile" in message
    assert "Fix: train.compile=false" in message


def test_compile_is_accepted_for_whole_backward_schedules_and_refused_for_fiw_csvs():
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
        validate(compose(*PP2, f"schedule={schedule}", "train.compile=true"))
    validate(compose(*PP2, "schedule=csv", f"schedule.csv={EXAMPLES / 'gpipe_pp2_m4.csv'}", "train.compile=true"))
    with pytest.raises(ConfigError, match="I/W actions split backward"):
        validate(compose(*PP2, "schedule=csv", f"schedule.csv={EXAMPLES / 'zero_bubble_pp2_m4.csv'}",
                         "train.compile=true"))


def test_compile_on_cpu_without_a_cxx_compiler_is_refused_before_launch(monkeypatch):
    import runner.ranks.host as host

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(host.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler.*Fix: install one, or train.compile=false"):
        validate(compose(*PP2, "train.compile=true"))


def test_tied_weights_may_share_a_stage_or_span_stages():
    assert validate(compose(*TINY, "parallel.pp=1", "model.tie_embeddings=true")).layout.num_stages == 1
    layout = validate(compose(*PP2, "model.tie_embeddings=true")).layout  # embedding and head on two ranks
    assert layout.stages[0][0] == "embed" and layout.stages[-1][-1] == "head"


def _csv(tmp_path, text: str) -> str:
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    return str(path)


CSV_BAD = [
    ("0F0,0X0\n1F0,1B0\n", ["malformed", "row 1 (rank 0), column 2: cannot read '0X0'"]),
    # torch's own cell parser reads these as 2F0 and 2B (no microbatch): ours reads cells whole.
    ("0F0,0B0\n1F0,2F0x\n", ["malformed", "row 2 (rank 1), column 2: cannot read '2F0x'"]),
    ("0F0,,0B0\n1F0,1B\n", ["malformed", "row 2 (rank 1), column 2: cannot read '1B'"]),
    ("0F0,(0F1)OVERLAP_F_B\n1F0\n", ["malformed", "column 2", "two or more compute actions"]),
    ("0F0,0I0,0W0\n1F0,1BW0\n", ["malformed", "mixes torch >= 2.6 notation"]),
    ("0F0,0B0\n", ["1 rows", "parallel.pp=1"]),
    ("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n", ["2 microbatches", "parallel.microbatches=2"]),
    ("0B0,0F0,0F1,0F2,0F3,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n",
     ["not a valid schedule", "without first running Forward"]),
    # Every action in a valid order per stage, but rank 1 waits on backwards never sent: deadlock.
    ("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1B0,1F0,1F1,1F2,1F3,1B1,1B2,1B3\n", ["not a valid schedule"]),
    # torch's validator counts each kind's microbatches as a set: a repeated cell passed it and failed
    # mid-step on a rank; B beside I/W for one microbatch passed where another's backward was missing.
    ("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,1B3\n",
     ["runs 1B3 twice (rank 1's row)", "Fix: remove one 1B3"]),
    ("0F0,0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n", ["runs 0F0 twice"]),
    ("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1I0,1F1,1I1,1F2,1I2,1F3,1I3,1W0,1W1,1W2,1W3,1W3\n", ["runs 1W3 twice"]),
    ("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0I0,0W0\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n",
     ["runs both the full backward 0B0 and a split one (0I0/0W0) on rank 0", "Fix: keep 0B0, or 0I0 then 0W0"]),
    ("0F0,0SEND_F0\n1RECV_F0,1F0\n", ["schedules 1 microbatches"]),  # a compute+comms file: its compute read
    ("", ["malformed", "no compute actions"]),
]


@pytest.mark.parametrize("text,expected", CSV_BAD, ids=[str(i) for i in range(len(CSV_BAD))])
def test_bad_csv_schedules_are_linted_before_spawning(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        validate(compose(*PP2, "schedule=csv", f"schedule.csv={_csv(tmp_path, text)}"))
    for part in expected:
        assert part in str(info.value), str(info.value)


def test_csv_schedule_gives_stage_count_and_placement():
    csv = EXAMPLES / "interleaved_1f1b_pp2_m4.csv"
    layout = validate(compose(*PP2, "schedule=csv", f"schedule.csv={csv}")).layout
    assert layout.num_stages == 4 and layout.stage_to_rank == {0: 0, 1: 1, 2: 0, 3: 1}
    with pytest.raises(ConfigError, match="parallel.stages_per_rank=3"):
        validate(compose(*PP2, "schedule=csv", f"schedule.csv={csv}", "parallel.stages_per_rank=3"))
    with pytest.raises(ConfigError, match="no such file"):
        validate(compose(*PP2, "schedule=csv", "schedule.csv=/nope.csv"))


def test_a_shipped_example_schedule_is_named_from_any_directory_and_a_users_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no examples/ here
    for name in ("interleaved_1f1b_pp2_m4", "interleaved_1f1b_pp2_m4.csv"):
        layout = validate(compose(*PP2, "schedule=csv", f"schedule.csv={name}")).layout
        assert layout.csv == str(EXAMPLES.resolve() / "interleaved_1f1b_pp2_m4.csv")
        assert layout.num_stages == 4 and layout.stage_to_rank == {0: 0, 1: 1, 2: 0, 3: 1}
    # A file of that name in the working directory is the one read, not the example.
    (tmp_path / "interleaved_1f1b_pp2_m4.csv").write_text((EXAMPLES / "gpipe_pp2_m4.csv").read_text())
    layout = validate(compose(*PP2, "schedule=csv", "schedule.csv=interleaved_1f1b_pp2_m4.csv")).layout
    assert layout.csv == "interleaved_1f1b_pp2_m4.csv" and layout.num_stages == 2
    with pytest.raises(ConfigError) as info:  # neither a file nor an example: the examples listed
        validate(compose(*PP2, "schedule=csv", "schedule.csv=zero_bubble_pp2_m8"))
    assert "no such file" in str(info.value)
    assert "gpipe_pp2_m4, interleaved_1f1b_pp2_m4, zbv_pp2_m4, zero_bubble_pp2_m4" in str(info.value)


def test_torch_schedule_file_shapes_are_read_whole_and_converted_with_a_log_line(tmp_path, caplog):
    """Pre-2.6 names (B = input backward, BW = full), compute+comms cells and OVERLAP_F_B cells."""
    from runner.pipeline.csv_file import read_schedule_file

    path = tmp_path / "schedule.csv"
    path.write_text("0F0,0SEND_F0,,0RECV_B0,0B0,0W0\n1RECV_F0,1F0,(1F1;1BW0)OVERLAP_F_B,1SEND_B0,1REDUCE_GRAD\n")
    read = read_schedule_file(path)
    assert {r: [op.name for op in ops] for r, ops in read.order.items()} == {0: ["0F0", "0I0", "0W0"],
                                                                            1: ["1F0", "1F1", "1B0"]}
    old, overlap, comms = read.notes
    assert "torch < 2.6" in old and "B -> I, BW -> B" in old
    assert overlap.startswith("1 OVERLAP_F_B cells") and "its 5 communication cells are left out" in comms
    path.write_text("0F0,0F1,0B0,0W0,0B1,0W1\n")  # B then W, no I: the old notation
    assert [op.name for op in read_schedule_file(path).order[0]] == ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"]
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0\n")  # F/B only: today's notation, nothing converted
    assert read_schedule_file(path).notes == ()
    path.write_text("0F0,0F1,0F2,0F3,0BW0,0BW1,0BW2,0BW3\n1F0,1F1,1F2,1F3,1BW0,1BW1,1BW2,1BW3\n")
    with caplog.at_level("WARNING", logger="runner.schedule"):
        layout = validate(compose(*PP2, "schedule=csv", f"schedule.csv={path}")).layout
    assert layout.num_stages == 2 and "BW -> B" in caplog.text


def test_checkpointing_with_split_backward_warns_of_the_recompute_cost(caplog):
    with caplog.at_level("WARNING", logger="runner.validate"):
        validate(compose(*PP2, "schedule=1f1b", "train.activation_checkpointing=full"))
        assert not caplog.records
        validate(compose(*PP2, "schedule=zbv", "train.activation_checkpointing=full"))
    assert "per parameter group" in caplog.text and "schedule=zbv" in caplog.text


def test_memory_sizes_take_the_forms_users_type():
    from runner.config import parse_bytes

    forms = [(2000000000, 2 * 10**9), ("2e9", 2 * 10**9), (2e9, 2 * 10**9), ("2GB", 2 * 10**9),
             ("1.5GiB", 3 * 2**29), ("512 MiB", 2**29), ("100kb", 10**5), (None, None)]
    assert [(form, parse_bytes("plan.memory_limit", form)) for form, _ in forms] == forms
    with pytest.raises(ConfigError, match=r"plan.memory_limit='2XB' is not a memory size\. Fix: .*2GB"):
        parse_bytes("plan.memory_limit", "2XB")
    assert compose(*TINY, "plan.memory_limit=2e9").plan.memory_limit == "2000000000.0"  # a float, as typed
    with pytest.raises(ConfigError, match="plan.memory_limit='lots'"):
        validate(compose(*TINY, "plan.memory_limit=lots"))


def test_verify_is_refused_before_launch_where_its_unsplit_reference_would_not_fit(monkeypatch):
    from runner.models.split import build_meta_model
    from runner.verify.memory import num_params, reference_bytes

    huge = [*PP2, "model.dim=65536", "model.n_layers=1"]  # 5e10 parameters: a TB of training state
    validate(compose(*huge))  # verify off: nothing trains it unsplit
    with pytest.raises(ConfigError) as info:
        validate(compose(*huge, "verify=true"))
    for text in ["verify=true: the unsplit reference needs about", "GiB is available", "Fix: verify=false",
                 "model.n_layers"]:
        assert text in str(info.value), str(info.value)
    # The estimate: 7 fp32 copies of every parameter (weights, gradients, AdamW's moments, the run's
    # copy gathered to compare, as it arrives), and the activations one microbatch leaves for backward.
    meta = build_meta_model(compose(*TINY).model)
    state = 7 * 4 * num_params(meta)
    estimate = reference_bytes(meta, microbatch=2, seq_len=16, kwargs={})
    assert state < estimate < 2 * state
    monkeypatch.setattr("runner.verify.memory.available_bytes", lambda: 10 * estimate)
    validate(compose(*PP2, "verify=true"))
    monkeypatch.setattr("runner.verify.memory.available_bytes", lambda: estimate // 2)
    with pytest.raises(ConfigError, match="unsplit reference needs about"):
        validate(compose(*PP2, "verify=true"))


def _hf_run(model_dir, *overrides: str):
    return compose("device=cpu", "model=hf", f"model.path={model_dir}", "model.pretrained=false",
                   "data.vocab_size=64", "train.seq_len=16", "train.batch_size=8", "parallel.microbatches=4",
                   *overrides)


def test_a_hf_model_too_shallow_for_the_layout_is_refused_before_its_corpus_is_tokenized(tmp_path, monkeypatch):
    from runner.validate import check_config

    from helpers.hf import write_model, write_tokenizer

    model_dir = write_model(tmp_path / "llama", "llama", weights=False, num_hidden_layers=2)  # 5 units
    write_tokenizer(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the pipeline stage runs every microbatch forward . " * 50)

    def tokenized(*args, **kwargs):
        raise AssertionError("the corpus was tokenized before the layout was checked")

    monkeypatch.setattr("runner.data.datasets.tokenize_to_cache", tokenized)
    monkeypatch.setattr("runner.data.datasets.check_batches", tokenized)
    cfg = _hf_run(model_dir, "data=text", f"data.path={corpus}", f"data.tokenizer={model_dir}",
                  "schedule=interleaved_1f1b", "parallel.pp=4", "parallel.microbatches=4")
    for check in (check_config, validate):  # the command line's check before torch; the launcher's
        with pytest.raises(ConfigError) as info:
            check(cfg)
        assert str(info.value) == (
            "The model has 5 pipeline units (one per layer, num_hidden_layers=2 in model.path's config.json, and "
            "the embedding, the final norm and the head) but the layout needs 8 stages (parallel.pp=4 x 2 stages "
            "per rank (schedule=interleaved_1f1b's default)). Fix: model.config_overrides.num_hidden_layers=5 or "
            "more, or lower parallel.pp or parallel.stages_per_rank.")
    # The user's own value is the one checked (and named).
    with pytest.raises(ConfigError, match=r"one per layer, model.config_overrides.num_hidden_layers=3, .*Fix: "
                                          r"model.config_overrides.num_hidden_layers=5 or more"):
        check_config(_hf_run(model_dir, "schedule=interleaved_1f1b", "parallel.pp=4",
                             "+model.config_overrides.num_hidden_layers=3"))


def test_a_hf_models_heads_and_positions_are_checked_from_its_config_json_by_its_own_names(tmp_path):
    from runner.validate import check_config

    from helpers.hf import write_model

    llama = write_model(tmp_path / "llama", "llama", weights=False)  # 4 heads, 2 kv heads, 64 positions
    gpt2 = write_model(tmp_path / "gpt2", "gpt2", weights=False)  # n_head=4, n_positions=64, n_layer=6
    with pytest.raises(ConfigError) as info:
        check_config(_hf_run(llama, "parallel.pp=1", "parallel.tp=4"))
    assert str(info.value) == ("parallel.tp=4 does not divide num_key_value_heads=2 in model.path's config.json: "
                               "each tensor-parallel shard holds whole heads. Fix: parallel.tp=2.")
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide n_head=4 in model.path's config.json.* "
                                          r"Fix: parallel.tp=2 or 4"):
        check_config(_hf_run(gpt2, "parallel.pp=1", "parallel.tp=3"))
    with pytest.raises(ConfigError) as info:
        check_config(_hf_run(llama, "train.seq_len=128"))
    assert str(info.value) == (
        "train.seq_len=128 is longer than the model takes: max_position_embeddings=64 in model.path's config.json. "
        "Positions past it have no embedding, or one it never trained on. Fix: train.seq_len=64 or less, or "
        "model.config_overrides.max_position_embeddings=128 to raise the limit (a model without learned position "
        "embeddings).")
    with pytest.raises(ConfigError, match=r"n_positions=64 in model.path's config.json.*"
                                          r"model.config_overrides.n_positions=128"):
        check_config(_hf_run(gpt2, "train.seq_len=128"))
    with pytest.raises(ConfigError, match=r"n_layer=6 in model.path's config.json.*model.config_overrides.n_layer=7"):
        check_config(_hf_run(gpt2, "schedule=interleaved_1f1b", "parallel.pp=5", "parallel.microbatches=5",
                             "train.batch_size=10"))
    # Raised by the user: the run goes ahead (validated with the model built, as a rank builds it).
    validate(_hf_run(llama, "train.seq_len=128", "+model.config_overrides.max_position_embeddings=128",
                     "parallel.pp=2"))


def test_the_registrys_stages_per_rank_is_torchs():
    from runner.pipeline.registry import SCHEDULES
    from runner.pipeline.schedule import default_stages_per_rank

    assert {n: k.stages_per_rank for n, k in SCHEDULES.items()} == {n: default_stages_per_rank(n) for n in SCHEDULES}
