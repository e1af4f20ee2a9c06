"""Run a function on N gloo ranks (``runner.ranks.processes.spawn``, as runs start theirs); the
tests put many cases into one call (``run_cases``) and assert each case apart.

The ranks of 2 and 4 are spawned once per test session and kept (``_Pool``): each ``spawn`` of
that size hands its function to the same live processes, which wait on a pipe between calls. A
rank spends ~4 CPU-s starting (an interpreter, torch's and the runner's imports, the process
group) and warming torch's caches (DTensor's sharding propagation, dispatch): paid once, not per
test module. Each call runs in the test process's environment, working directory and import path
of the moment (``_as_called``), as ranks spawned for it would; ``fresh=True`` spawns ranks of the
call's own (a test whose ranks must start under a variable it sets). A rank that fails ends its
pool (the next call spawns a new one); the pools end with the session (``close_pools``,
conftest.py), where every rank must still leave cleanly."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from runner.errors import RunnerError
from runner.hooks import Hook, StepContext, StepState
from runner.ranks.processes import spawn as spawn_ranks
from runner.train import train
from runner.validate import validate
from runner.verify.hook import gather, gather_grads

from helpers import tier

POOLED = (2, 4)  # the world sizes whose ranks are kept between calls (8 ranks: spawned per call)


def spawn(world: int, fn, *args, threads_left_because: str | None = None, fresh: bool = False) -> None:
    """``fn(env, *args)`` on ``world`` ranks; ``args[0]`` is the cases' directory (made here). Every
    rank must also end cleanly: no process-group thread left running into its interpreter's exit
    (``runner.ranks.dist.cleanup`` warns; a rank with such threads could abort after all its work),
    unless ``threads_left_because`` says why a test accepts them (its ranks are its own, then).
    ``fresh``: ranks of this call's own, started now (a test that sets the ranks' environment)."""
    tier.check("runs ranks")  # pooled ranks start no process: the marker is checked here too
    directory = Path(args[0])
    directory.mkdir(parents=True, exist_ok=True)
    if world in POOLED and not fresh and threads_left_because is None:
        _pool(world).run(fn, args)  # in this process's environment, directory and path (``_as_called``)
        return
    with spawn_ranks(world, fn, *args, directory=directory, timeout_s=120, method="spawn", threads=1,
                     prelude=functools.partial(_keep_exit_warnings, str(directory))) as ranks:
        ranks.join()
    _assert_left_cleanly(directory, threads_left_because)


def _assert_left_cleanly(directory: Path, threads_left_because: str | None = None) -> None:
    warned = sorted(directory.glob("exit-warnings-rank*.log"))
    assert threads_left_because or not warned, "\n".join(f"{f.name}: {f.read_text()}" for f in warned)


def _keep_exit_warnings(directory: str, rank: int) -> None:
    """In each rank: ``runner.ranks.dist``'s warnings (its cleanup's) go to a file the spawn looks for."""
    handler = logging.FileHandler(Path(directory) / f"exit-warnings-rank{rank}.log", delay=True)  # made if used
    handler.setLevel(logging.WARNING)
    logging.getLogger("runner.dist").addHandler(handler)


def _caller() -> tuple[dict[str, str], str, list[str]]:
    """What a spawned rank takes from the test process: its environment (a test's
    ``monkeypatch.setenv``), working directory and import path."""
    return dict(os.environ), os.getcwd(), list(sys.path)


@contextlib.contextmanager
def _as_called(caller: tuple[dict[str, str], str, list[str]], own: dict[str, str]):
    """In a pooled rank, for one call: the caller's environment (with the variables this rank set
    for itself, ``own``), working directory and import path, as a rank spawned now would start."""
    environ, cwd, path = caller
    saved = dict(os.environ), os.getcwd(), list(sys.path)
    os.environ.clear()
    os.environ.update({**environ, **own})
    os.chdir(cwd)
    sys.path[:] = path
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        os.chdir(saved[1])
        sys.path[:] = saved[2]


def _serve(env, conns: list, started: dict[str, str]) -> None:
    """A pooled rank: run each ``(fn, args, caller)`` its pipe brings (``_as_called``), answer None
    or the traceback; return (leave the process group, exit) at None or when the test process is
    gone. ``started``: the test process's environment when it spawned the pool."""
    conn = conns[env.rank]
    for other in conns:
        if other is not conn:
            other.close()
    own = {k: v for k, v in os.environ.items() if started.get(k) != v}  # e.g. runner.ranks.dist's gloo interface
    while True:
        try:
            job = conn.recv()
            if job is None:
                return
            fn, args, caller = job  # unpickled here: fn's module imported by name
            with _as_called(caller, own):
                fn(env, *args)
        except EOFError:
            return
        except BaseException:
            conn.send(traceback.format_exc())
            raise
        conn.send(None)


class _Pool:
    """``world`` spawned ranks serving calls (``_serve``), one pipe each."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.directory = Path(tempfile.mkdtemp(prefix=f"runner-test-ranks{world}-"))
        pipes = [multiprocessing.get_context("spawn").Pipe() for _ in range(world)]
        self.conns = [ours for ours, _ in pipes]
        self.ranks = spawn_ranks(world, _serve, [theirs for _, theirs in pipes], dict(os.environ),
                                 directory=self.directory,
                                 timeout_s=120, method="spawn", threads=1,
                                 prelude=functools.partial(_keep_exit_warnings, str(self.directory)))
        for _, theirs in pipes:
            theirs.close()
        self.calls: list[str] = []  # what ran here, for a failure's message

    def run(self, fn, args: tuple) -> None:
        """``fn(env, *args)`` on every rank; a rank's error (or death) ends the pool and is raised."""
        self.calls.append(f"{fn.__module__}.{fn.__qualname__}({args[0]})")
        try:
            caller = _caller()
            for conn in self.conns:
                conn.send((fn, args, caller))
            failures = self._wait()
        except BaseException:  # a test's timeout, an interrupt: the ranks' state is unknown
            self.close(kill=True)
            raise
        if failures:
            self.close(kill=True)
            raise AssertionError(f"{self.world} pooled ranks failed in {self.calls[-1]}:\n" + "\n".join(failures))

    def _wait(self) -> list[str]:
        """Every rank's answer; at the first error or dead rank, what failed."""
        pending = dict(enumerate(self.conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.ranks.processes)}
        while pending:
            for ready in multiprocessing.connection.wait([*pending.values(), *sentinels]):
                rank = sentinels[ready] if ready in sentinels else next(r for r, c in pending.items() if c is ready)
                if rank not in pending or not pending[rank].poll():  # ended without a word: its peers cannot go on
                    return [f"rank {rank} exited with code {self.ranks.processes[rank].exitcode}"]
                try:
                    answer = pending.pop(rank).recv()
                except EOFError:
                    return [f"rank {rank} exited with code {self.ranks.processes[rank].exitcode}"]
                if answer is not None:
                    return [f"rank {rank}: {answer}"]
        return []

    def close(self, *, kill: bool = False) -> None:
        """End the ranks: asked to leave (each leaves its process group and exits, within 60 s, with
        code 0 and no process-group thread left), or killed."""
        _pools.pop(self.world, None)
        processes = self.ranks.processes
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(None)
            deadline = time.monotonic() + 60
            for p in processes:
                p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in processes]
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(10)
        for conn in self.conns:
            conn.close()
        self.ranks.close()
        try:
            if not kill:
                assert codes == [0] * self.world, f"pooled ranks' exit codes (None: killed after 60 s): {codes}"
                _assert_left_cleanly(self.directory)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


_pools: dict[int, _Pool] = {}


def _pool(world: int) -> _Pool:
    if world not in _pools:
        _pools[world] = _Pool(world)
    return _pools[world]


def close_pools() -> None:
    """End the session's pooled ranks (conftest.py, at the session's end): each must leave cleanly."""
    failures = []
    for pool in list(_pools.values()):
        try:
            pool.close()
        except AssertionError as e:
            failures.append(f"{pool.world} ranks, after {', '.join(pool.calls)}: {e}")
    assert not failures, "\n".join(failures)


class FirstGrads(Hook):
    """The first step's gradients on rank 0 (by full parameter name), before and after clipping."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor | None] = {}
        self.clipped: dict[str, torch.Tensor | None] = {}

    def after_reduce(self, ctx: StepContext, state: StepState) -> None:
        if state.first:
            self.grads = gather_grads(ctx.modules, ctx.env, skip=ctx.not_counted)

    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        if state.first:
            self.clipped = gather_grads(ctx.modules, ctx.env, skip=ctx.not_counted)


class FinalWeights(Hook):
    """After the run's last step, every weight (by full name, a tied weight once) and its AdamW
    moments in rank 0's run directory, ``weights.pt``: what a run ends with, to compare exactly."""

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.step != ctx.resolved.steps:
            return
        state_of = ctx.optimizer.state
        final = {"weights": gather(ctx.modules, ctx.env, lambda p: p, ctx.not_counted)}
        for key in ("exp_avg", "exp_avg_sq"):
            final[key] = gather(ctx.modules, ctx.env, lambda p, key=key: state_of[p][key], ctx.not_counted)
        if ctx.env.is_main:
            assert ctx.resolved.run_dir is not None
            torch.save(final, ctx.resolved.run_dir / "weights.pt")


def final_weights() -> list[Hook]:
    """``run_cases``' ``more_hooks`` for ``FinalWeights``."""
    return [FinalWeights()]


class StagesLeft(Hook):
    """Weak references to this rank's stage modules; ``alive()``, once the run has returned: how
    many something still holds (a finished run must leave none: a module kept alive keeps its
    process groups and their threads running into the interpreter's exit)."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        if state.first:
            self.refs = [weakref.ref(m) for m in ctx.modules]

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


def stages_left() -> list[Hook]:
    """``run_cases``' ``more_hooks`` for ``StagesLeft``: each record's ``stages_alive`` (rank 0's)."""
    return [StagesLeft()]


@contextlib.contextmanager
def _fault(spec: str | None):
    """``RUNNER_FAULT=<spec>`` (``runner.faults``) in this rank while one case trains."""
    if spec is None:
        yield
        return
    os.environ["RUNNER_FAULT"] = spec
    try:
        yield
    finally:
        del os.environ["RUNNER_FAULT"]


def validate_once(cfg, run_dir: Path, env):
    """The case's ``ResolvedRun``, validated once (rank 0) and handed to every rank as a launch
    hands it to its ranks (``runner.launch``); or the runner error it raised, as a record."""
    box: list = [None]
    if env.is_main:
        try:
            box[0] = validate(cfg, run_dir)
        except RunnerError as e:
            box[0] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    if env.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def train_cases(env, out_dir: str, cases: dict[str, dict], more_hooks=None, faults=None) -> None:
    """Train every case on the same process group; rank 0 saves losses, first-step gradients
    and the summary, or the runner error every rank raised, to ``<out_dir>/<case>.pt``.
    ``more_hooks``: a function (importable by the ranks) making each case's other hooks;
    ``faults``: case -> the ``RUNNER_FAULT`` it trains under."""
    for name, cfg_dict in cases.items():
        cfg = OmegaConf.create(cfg_dict)
        run_dir = Path(out_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = validate_once(cfg, run_dir, env)
        if isinstance(resolved, dict):  # refused: the same record on every rank
            record = resolved
        else:
            try:
                grads, more = FirstGrads(), more_hooks() if more_hooks else []
                with _fault((faults or {}).get(name)):
                    result = train(resolved, cfg, env, hooks=[grads, *more])
                record = {"losses": result.losses, "grads": grads.grads, "clipped": grads.clipped,
                          "summary": result.summary}
                for hook in (h for h in more if isinstance(h, StagesLeft)):
                    record["stages_alive"] = hook.alive()
            except RunnerError as e:
                record = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if env.is_main:
            torch.save(record, Path(out_dir) / f"{name}.pt")


def run_cases(out_dir: Path, world: int, cases: dict[str, dict], more_hooks=None,
              faults: dict[str, str] | None = None, threads_left_because: str | None = None,
              fresh: bool = False) -> dict[str, dict]:
    """``world`` ranks (``spawn``) train every case (name -> resolved config, see
    ``helpers.config.resolved``); returns each case's record (``train_cases``)."""
    spawn(world, train_cases, str(out_dir), cases, more_hooks, faults, threads_left_because=threads_left_because,
          fresh=fresh)
    return {name: torch.load(Path(out_dir) / f"{name}.pt", weights_only=False) for name in cases}
