"""The command lines' edges: `~` in an override's value, a folder named `runner` where the command
runs, the planner's exit codes and its config errors reported once, and what a run prints besides
its own lines (the profiler's markers, its warm-up warning, the tied-weight line, gloo's interface)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from runner.errors import ConfigError
from runner.exits import expand_home
from runner.launch import launch
from runner.pipeline.schedule import SCHEDULES
from runner.plan.__main__ import _no_valid_candidate
from runner.plan.planner import Candidate, check_plan_keys, check_schedules, plan, tried_schedules
from runner.plan.target import plan_target
from runner.ranks.dist import init_distributed
from runner.validate import check_config, validate

from helpers.cli import finish, start_cli
from helpers.config import TINY, compose
from helpers.plan import FIXED


def test_a_tilde_opening_an_override_value_is_the_home_directory(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    args = ["model.path=~/models/llama", "data.tokenizer=~", "+extra=~/a", "data.path=~/a,~/b", "k=[~/a,~]",
            "~model.pretrained", "hydra.run.dir=runs/~x", "name=a~/b", "--cfg", "job", "x=~user/y"]
    assert expand_home(args) == ["model.path=/home/u/models/llama", "data.tokenizer=/home/u", "+extra=/home/u/a",
                                 "data.path=/home/u/a,/home/u/b", "k=[/home/u/a,/home/u]", "~model.pretrained",
                                 "hydra.run.dir=runs/~x", "name=a~/b", "--cfg", "job", "x=~user/y"]


def test_the_planners_own_keys_are_checked_once_before_anything_is_timed(tmp_path):
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8"]
    with pytest.raises(ConfigError, match=r"plan.memory_limit='lots' is not a memory size\. Fix: "):
        plan(compose(*common, "plan.memory_limit=lots"))
    with pytest.raises(ConfigError, match=r"plan.costs='.*garbage'.*Fix: point it at a run directory"):
        check_plan_keys(compose(*common, f"plan.costs={tmp_path / 'garbage'}"))
    with pytest.raises(ConfigError, match=r"plan.microbatches=\[3, 5\]: none divides a replica's batch "
                                          r"\(train.batch_size=8 / parallel.dp=1\).*Fix: "):
        check_plan_keys(compose(*common, "plan.microbatches=[3,5]"))
    with pytest.raises(ConfigError, match=r"plan.microbatches=\[\]"):
        check_plan_keys(compose(*common, "plan.microbatches=[]"))
    # The link (plan.comm_*): a zero bandwidth divided by zero in plan.target, a negative one made no candidate.
    for override, shown in (("plan.comm_bandwidth=0", "plan.comm_bandwidth=0"),
                            ("plan.comm_bandwidth=-5", "plan.comm_bandwidth=-5"),
                            ("plan.comm_latency_s=-1e-6", "plan.comm_latency_s=-1e-06")):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^{shown}: .* Fix: e\.g\. {key}=\S+, or null for that default\.$"):
            check_plan_keys(compose(*common, override))
    with pytest.raises(ConfigError, match=r"plan.comm_bandwidth=0: a link's bandwidth is a positive number"):
        plan_target(compose(*TINY, "plan.target=nvidia a100", "plan.world_size=2", "plan.comm_bandwidth=0"))
    for override, least in (("plan.action_overhead_s=-1e-05", "0"), ("plan.corunning_slowdown=0.5", "1"),
                            ("plan.comm_busy_delay_s=-0.001", "0"), ("plan.action_jitter=-0.1", "0")):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^{override}: it is .*, at least {least}\. Fix: {key}={least} or "
                                              r"more, or null to measure it\.$"):
            check_plan_keys(compose(*common, override))
    check_plan_keys(compose(*common, "plan.memory_limit=2GB", "plan.comm_latency_s=0",
                            "plan.corunning_slowdown=1", "plan.action_jitter=0"))  # valid ones pass


@pytest.mark.timeout(60)
def test_a_name_in_plan_schedules_that_is_no_schedule_fails_with_the_config_checks():
    # check_config: what python -m runner, python -m runner.plan, runner.run and runner.plan run first.
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8"]
    listed = r"\['gpipe', '1f1b', 'interleaved_1f1b', .*'zbv', .*\]"
    for typo, shown in (("[1f1b,onef1b]", r"\['1f1b', 'onef1b'\] has unknown values \['onef1b'\]"),
                        ("[csv]", r"\['csv'\] has unknown values \['csv'\]")):  # csv: the run's own file only
        cfg = compose(*common, f"plan.schedules={typo}")
        for check in (check_config, check_plan_keys):  # and plan() checks it before anything is timed
            with pytest.raises(ConfigError, match=rf"^plan\.schedules={shown}\. Fix: a subset of {listed}, or "
                                                  r"plan\.schedules=null\.$"):
                check(cfg)
    check_config(compose(*common))  # null: every schedule
    check_config(compose(*common, "plan.schedules=[zbv,1f1b]"))
    assert tried_schedules(compose(*common, "plan.schedules=[zbv,1f1b]")) == ["1f1b", "zbv"]
    # A list option that takes no null says no null.
    with pytest.raises(ConfigError, match=r"train\.no_decay=\['gain'\] has unknown values \['gain'\]\. Fix: a subset "
                                          r"of \['bias', 'norm', 'embedding'\]\.$"):
        check_config(compose(*common, "train.no_decay=[gain]"))


@pytest.mark.timeout(120)
def test_plan_schedules_limits_the_candidates_to_the_schedules_named(tmp_path):
    common = [*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8"]
    with pytest.raises(ConfigError, match=r"plan.schedules=\[\]: no schedule to try\. Fix: "):
        check_plan_keys(compose(*common, "plan.schedules=[]"))
    with pytest.raises(ConfigError, match=r"plan.schedules=\['gpipe'\] with plan.target=h100: .*Fix: "):
        check_schedules(compose(*common, "plan.schedules=[gpipe]", "plan.target=h100"))
    assert tried_schedules(compose(*common)) == list(SCHEDULES)
    candidates, _, _, _ = plan(compose(*common, "plan.schedules=[1f1b]", "plan.microbatches=[2,4]",
                                       "plan.repeats=1"))
    assert sorted((c.schedule, c.microbatches, c.stages_per_rank) for c in candidates if c.split_points is None) \
        == [("1f1b", 2, 1), ("1f1b", 4, 1)]


def test_when_no_candidate_can_run_the_shared_reason_is_given_once():
    def rejected(reason: str) -> Candidate:
        return Candidate("1f1b", 4, 1, [], valid=False, reason=reason)

    missing = "data.path='x': no such file. Fix: data.path=<a local text file>."
    text = _no_valid_candidate([rejected(missing)] * 38 + [rejected("ZBV requires exactly 2 stages per rank")] * 13)
    assert text.count(missing) == 1 and text.startswith(f"no candidate layout can run: {missing} (38 of 51")
    assert text.endswith("The other 13 are layouts with reasons of their own, e.g. ZBV requires exactly 2 stages "
                         "per rank")
    assert _no_valid_candidate([rejected(missing)] * 3) == f"no candidate layout can run: {missing} (3 of 3 candidates)"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_planner_command_line_exits_as_the_runner_does(tmp_path):
    common = ["experiment=smoke", *FIXED, "plan.microbatches=[4]", "plan.repeats=1"]
    cases = {  # arguments, exit code, what stderr says
        "typo": (["plan.memroy_limit=1"], 2, "Key 'memroy_limit' not in 'PlanConfig'"),
        "size": (["plan.memory_limit=lots"], 2, "error: plan.memory_limit='lots' is not a memory size"),
        "costs": (["plan.costs=~/nowhere"], 2, f"error: plan.costs='{tmp_path}/nowhere' is not a finished run"),
        "fits": (["plan.memory_limit=1"], 3, "error: no valid candidate keeps its in-flight activations within "
                                            "plan.memory_limit=1"),
    }
    procs = {name: start_cli(*common, *args, f"hydra.run.dir={name}", module="runner.plan", cwd=tmp_path,
                             env={"HOME": str(tmp_path)})
             for name, (args, _, _) in cases.items()}
    done = {name: finish(proc, timeout=200) for name, proc in procs.items()}
    for name, (_, code, said) in cases.items():
        err = done[name].stderr
        assert done[name].returncode == code and said in err, (name, done[name].returncode, err[-2000:])
        assert "Traceback" not in err and err.count("error:") <= 1, (name, err)
    assert not (tmp_path / "size" / "plan.json").exists()  # nothing planned: the error before any candidate
    assert "over limit" in done["fits"].stdout and (tmp_path / "fits" / "plan.json").is_file()


def test_a_folder_named_runner_in_the_working_directory_fails_before_any_work(tmp_path, monkeypatch, capsys):
    # What `import runner` gives `python -m runner` run beside a folder named runner when the runner
    # is an editable install (setuptools' finder comes after the path): a namespace package of both
    # folders, without runner/__init__.py run.
    import types

    import runner.__main__ as entry

    (tmp_path / "runner").mkdir()
    merged = types.ModuleType("runner")
    merged.__path__ = [str(tmp_path / "runner"), str(Path(entry.__file__).parent)]
    monkeypatch.setitem(sys.modules, "runner", merged)
    monkeypatch.setattr(sys, "argv", ["runner", "experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as info:
        entry.cli()
    assert info.value.code == 2 and not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert err.startswith(f"error: the folder {tmp_path / 'runner'} shadows the runner package: ")
    assert err.rstrip().endswith("Fix: run from another directory, or use the `runner` command.")


def test_tied_weight_line_says_what_each_placement_holds(caplog):
    caplog.set_level(logging.INFO, logger="runner.parallel.tied")
    tied = [*TINY, "model.tie_embeddings=true", "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]
    validate(compose(*tied, "schedule=zbv"))  # V: the first and the last stage on rank 0
    validate(compose(*tied, "schedule=zbv", "parallel.dp_mode=ddp"))  # wrapped per stage: a copy each
    validate(compose(*tied, "schedule=1f1b"))  # the ends on ranks 0 and 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Tied weight")]
    assert [line.split(": ", 1)[1] for line in lines] == ["one parameter", "a copy each, gradients summed",
                                                          "a copy each, gradients summed"]
    assert [line.split(" spans ")[1].split(":")[0] for line in lines] == [
        "stages [0, 3] on ranks [0]", "stages [0, 3] on ranks [0]", "stages [0, 1] on ranks [0, 1]"]


def test_spawned_ranks_put_gloo_on_loopback_whatever_the_shell_set(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    seen = []
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda **kwargs: seen.append((os.environ["GLOO_SOCKET_IFNAME"], kwargs["store"])))
    init_distributed(rank=0, world_size=2, device=torch.device("cpu"), timeout_s=5, store="a store")
    assert seen == [("lo", "a store")]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # torchrun's ranks (no store): the interface across hosts
    init_distributed(rank=0, world_size=2, device=torch.device("cpu"), timeout_s=5, store=None)
    assert seen[-1] == ("eth7", None)


def test_a_short_profiled_run_prints_nothing_of_the_profilers_own(tmp_path, capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="runner.profile")
    cfg = compose(*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4", "train.steps=2",
                  "profile.enabled=true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch(cfg, tmp_path)  # one rank, in this process: a window clamped to 2 steps, no warm-up
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err, err
    assert not [w for w in caught if "warmup" in str(w.message)]
    markers = [r.getMessage() for r in caplog.records
               if r.name == "runner.profile" and r.levelno == logging.DEBUG]
    assert any(m.startswith("torch profiler: USDT") and m.endswith("profiler_start") for m in markers), markers
    assert (tmp_path / "traces" / "rank0.json").is_file() and (tmp_path / "timeline.json").is_file()
