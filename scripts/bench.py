"""Benchmarks: pipeline efficiency, scaling and memory, training options, runner overhead, startup,
profiling cost, the planner against real runs (three model sizes), synthesized schedules against the
built-ins, and what one device measures alone. Each section
saves its raw results to benchmarks/<section>.json; BENCHMARKS.md is rendered from every JSON file
present, so re-running one section refreshes only that part.

    python scripts/bench.py                                # every section (~1.5 h on 2 cores, plus waits)
    python scripts/bench.py --only options startup         # these sections; the others' JSON is kept
    python scripts/bench.py --only efficiency --pp 2 --microbatches 8
    python scripts/bench.py --render                       # re-render BENCHMARKS.md (and the plot) only
    python scripts/bench.py --device cuda                  # on GPUs: benchmarks/cuda/, BENCHMARKS-cuda.md
    python scripts/bench.py --only planner synthesis --quick   # do they run (tiny models, ~5 min)

Before each long run the script waits (up to --max-wait s) until the 1-minute load average is at
most 1.0 and no pytest is running, and records per section whether it ran under load. Benchmarks
write numbers and never fail on one: a failed run is recorded with its error. Every number in one
table comes from one invocation on one machine; ratios, not absolute times, carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["efficiency", "scaling", "options", "overhead", "startup", "profiling", "planner", "synthesis",
            "device", "hf"]
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
ZERO_BUBBLE = ["interleaved_zb", "zbv", "dualpipev"]
_SHAPE = ["model.dim=256", "model.n_layers=8", "train.seq_len=128"]  # every run also gets device=<--device>
# Efficiency and scaling: 64 samples per step, so a stage's forward on one microbatch stays near or
# above 20 ms on CPU down to m=16 at pp=4 with 2 stages per rank (one block per stage); a message
# (a microbatch's activations) costs well under a millisecond over loopback gloo.
SWEEP_MODEL = [*_SHAPE, "train.batch_size=64"]
# The other sections (ratios at pp=2, m=8: 4 samples per microbatch, 35-150 ms per stage forward).
MODEL = [*_SHAPE, "train.batch_size=32"]
OPTIONS = {  # name -> overrides, at pp=2 m=8; ratios are taken against the baseline named in OPTION_RATIOS
    "1f1b": ["schedule=1f1b"],
    "1f1b+ac": ["schedule=1f1b", "train.activation_checkpointing=full"],
    "zbv": ["schedule=zbv"],
    "zbv+ac": ["schedule=zbv", "train.activation_checkpointing=full"],
    "1f1b+bf16": ["schedule=1f1b", "train.precision=bf16"],
    "1f1b+compile": ["schedule=1f1b", "train.compile=true"],
}
# bf16 matmuls run ~8x slower than fp32 on a CPU without native bf16 (AVX2 only): fewer steps, one repeat.
OPTION_LIMITS = {"1f1b+bf16": {"steps": 4, "repeats": 1}}
# One device, pp=1 (the unsplit model): the options without a pipeline.
SINGLE = {"pp1": [], "pp1+ac": ["train.activation_checkpointing=full"], "pp1+bf16": ["train.precision=bf16"],
          "pp1+compile": ["train.compile=true"]}
SINGLE_LIMITS = {"pp1+bf16": {"steps": 3, "repeats": 1}}  # on CPU only (no native bf16 here)
SINGLE_RATIOS = [("activation checkpointing full / none", "pp1+ac", "pp1"), ("bf16 / fp32", "pp1+bf16", "pp1"),
                 ("compile / eager", "pp1+compile", "pp1")]
OPTION_RATIOS = [  # (label, config, baseline)
    ("activation checkpointing full / none, 1f1b", "1f1b+ac", "1f1b"),
    ("activation checkpointing full / none, zbv", "zbv+ac", "zbv"),
    ("bf16 / fp32, 1f1b", "1f1b+bf16", "1f1b"),
    ("compile / eager, 1f1b", "1f1b+compile", "1f1b"),
    ("zbv / 1f1b (no options)", "zbv", "1f1b"),
]
MIB = 2**20
# A Llama-shaped Hugging Face model (random weights saved in its directory: the pretrained path),
# 8 layers of width 256, a 8192-token vocabulary; at pp=2 against its unsplit run.
HF_LLAMA = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256}
HF_RUNS = {"pp1": ["parallel.pp=1"], "pp2-1f1b": ["parallel.pp=2", "schedule=1f1b"],
           "pp2-zbv": ["parallel.pp=2", "schedule=zbv"]}

# Planner validation over model sizes: name -> (model overrides, microbatch counts, steps per run).
# Actions of ~0.2-0.6 ms (the smoke model), 1-3 ms (issue 19's model at the default width) and
# 30-250 ms (MODEL): the planner must hold at each, not only where compute dwarfs the runtime.
PLANNER_SIZES = {
    "smoke": (["model.dim=32", "model.n_layers=2", "train.seq_len=16", "train.batch_size=8"], [2, 4], 30),
    "small": (["model.n_layers=8", "train.batch_size=32"], [2, 4], 20),
    "benchmark": (MODEL, [4, 8], 8),
}
# Synthesis against the built-ins: a large-vocabulary head (a last stage 2-3x the others) and
# equal stages (8 blocks of width 128, a small head).
SYNTH_MODELS = {
    "heavy-last": ["model.dim=64", "model.n_layers=6", "data.vocab_size=8192", "train.batch_size=32"],
    "equal": ["model.dim=128", "model.n_layers=8", "train.seq_len=64", "train.batch_size=32"],
}
QUICK_SIZES = {"smoke": PLANNER_SIZES["smoke"]}  # --quick: does the section run at all (minutes)
QUICK_SYNTH = {"heavy-last": ["model.dim=32", "model.n_layers=2", "data.vocab_size=1024", "train.seq_len=16",
                              "train.batch_size=8"]}


# ---------------------------------------------------------------------------------------------
# Pure helpers (unit-tested in tests/test_scripts.py)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float] | None:
    """Least squares y = a + b x: (a, b, Pearson r), or None for fewer than 3 distinct x."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    r = sxy / (sxx * syy) ** 0.5 if syy > 0 else 0.0
    return my - b * mx, b, r


def steady(step_times: Sequence[float], skip: int = 1) -> float | None:
    """Median step time after the first ``skip`` steps (shape inference, compilation, warm-up)."""
    rest = list(step_times[skip:])
    return statistics.median(rest) if rest else None


# ---------------------------------------------------------------------------------------------
# Machine, load and runs


def _device_name(device: str) -> str:
    import torch

    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if device == "cuda" else "CPU"


def machine(device: str = "cpu") -> dict[str, Any]:
    import torch

    from runner.provenance import cpu_name

    return {"arch": platform.machine(), "cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "device": device,
            "device_name": _device_name(device)}


def _pytest_running() -> bool:
    try:
        return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def wait_for_quiet(label: str, max_wait_s: float, poll_s: float = 30.0, threshold: float = 1.0) -> dict[str, Any]:
    """Wait until the 1-minute load average is <= threshold and no pytest runs (or max_wait_s)."""
    start = time.time()
    while True:
        load1, tests = os.getloadavg()[0], _pytest_running()
        waited = time.time() - start
        if (load1 <= threshold and not tests) or waited >= max_wait_s:
            quiet = load1 <= threshold and not tests
            if not quiet:
                print(f"[bench] {label}: still busy after {waited:.0f} s (load {load1:.2f}, pytest {tests}); "
                      "running anyway", flush=True)
            return {"label": label, "waited_s": round(waited, 1), "quiet": quiet, "load1": load1, "pytest": tests}
        print(f"[bench] {label}: waiting for a quiet machine (load {load1:.2f}, pytest running: {tests})", flush=True)
        time.sleep(poll_s)


def _cpu_busy_s() -> float | None:
    """Seconds of busy CPU time on the whole machine since boot (/proc/stat), or None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float | None:
    """CPU seconds of a process tree: each live process's own and its reaped children's time
    (/proc/<pid>/stat utime, stime, cutime, cstime), so time moves, and is kept, from a child
    to its parent as the child is reaped. None off Linux."""
    clock = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            rest = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(entry)
        children.setdefault(int(rest[1]), []).append(pid)
        times[pid] = sum(int(v) for v in rest[11:15]) / clock
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


class LoadMonitor:
    """Samples, every ``interval_s`` during a section: whether a pytest runs, and the share of the
    machine's CPU that processes outside this script's tree used since the last sample (busy CPU
    time from /proc/stat minus this tree's). ``loaded(start, end)`` says whether a run in that
    window shared the machine."""

    def __init__(self, interval_s: float = 10.0, threshold: float = 0.1):
        self.interval_s, self.threshold = interval_s, threshold
        self.samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _read(self) -> tuple[float, float | None, float | None]:
        return time.time(), _cpu_busy_s(), _tree_cpu_s(os.getpid())

    def sample(self) -> None:
        with self._lock:
            now, busy, own = self._read()
            t0, busy0, own0 = self._last
            foreign = None
            if None not in (busy, own, busy0, own0) and now > t0:
                foreign = max(0.0, (busy - busy0) - (own - own0)) / ((now - t0) * (os.cpu_count() or 1))
            self.samples.append({"t0": t0, "t": now, "foreign": None if foreign is None else round(foreign, 3),
                                 "pytest": _pytest_running()})
            self._last = (now, busy, own)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def loaded(self, start: float | None, end: float | None) -> bool | None:
        """Whether another process used the machine while a run went from ``start`` to ``end``."""
        if start is None or end is None:
            return None
        self.sample()  # close the interval the run ended in
        with self._lock:
            over = [s for s in self.samples if s["t"] > start and s["t0"] < end]
        if not over:
            return None
        shares = [s["foreign"] for s in over if s["foreign"] is not None]
        return any(s["pytest"] for s in over) or (bool(shares) and statistics.fmean(shares) > self.threshold)

    def __enter__(self) -> LoadMonitor:
        self.start = time.time()
        self._last = self._first = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        t0, busy0, own0 = self._first
        t1, busy1, own1 = self._last
        share = None
        if None not in (busy0, own0, busy1, own1) and t1 > t0:
            share = max(0.0, (busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * (os.cpu_count() or 1))
        self.report = {"pytest_samples": sum(s["pytest"] for s in self.samples), "samples": len(self.samples),
                       "loaded_samples": sum(bool(s["pytest"] or (s["foreign"] or 0) > self.threshold)
                                             for s in self.samples),
                       "foreign_cpu_share": None if share is None else round(share, 3)}


def _runner(ctx: Context, *args: str, module: str = "runner", env: Mapping[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """``python -m runner`` (or ``runner.plan``) with these overrides, on the benchmark's device."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args, f"device={ctx.args.device}"], cwd=ctx.work,
                          env=full_env, capture_output=True, text=True)


def _error(run_dir: Path, done: subprocess.CompletedProcess | None) -> str:
    error_file = run_dir / "error.txt"
    if error_file.is_file():
        return error_file.read_text().strip().splitlines()[0][:300]
    if done is not None:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return (tail[-1] if tail else f"exit code {done.returncode}")[:300]
    return "no summary.json"


def read_run(run_dir: Path, done: subprocess.CompletedProcess | None = None) -> dict[str, Any]:
    """What a benchmark keeps of one run: its summary's numbers and every step time."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return {"status": "failed", "error": _error(run_dir, done), "dir": str(run_dir)}
    s = json.loads(summary_file.read_text())
    metrics = run_dir / "metrics.jsonl"
    step_times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()] \
        if metrics.is_file() else []
    bubble = s.get("bubble") or {}
    return {
        "status": "ok", "dir": str(run_dir),
        "step_time_s": s.get("step_time_s"), "tokens_per_s": s.get("tokens_per_s"), "step_times": step_times,
        "bubble": bubble.get("mean"), "bubble_per_rank": bubble.get("per_rank"),
        "bubble_theoretical": bubble.get("theoretical"), "theoretical_source": bubble.get("theoretical_source"),
        "bubble_simulated": bubble.get("simulated"), "simulated_step_s": bubble.get("simulated_step_s"),
        "pipeline_step_s": bubble.get("pipeline_step_s"),
        "mean_costs_s": bubble.get("mean_costs_s", {}),
        "peak_mem_bytes": s.get("peak_mem_bytes"), "stages": s.get("stages"), "num_stages": s.get("num_stages"),
        "startup_s": s.get("startup_s"), "startup_phases_s": s.get("startup_phases_s"),
        "final_loss": s.get("final_loss"), "started_at": s.get("started_at"), "finished_at": s.get("finished_at"),
        "weights_read_bytes": s.get("weights_read_bytes"),
    }


def _job_overrides(job_dir: Path) -> dict[str, str]:
    import yaml

    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    return dict(o.split("=", 1) for o in overrides)


# ---------------------------------------------------------------------------------------------
# Sections. Each takes a Context and returns a JSON-able dict of raw results.


class Context:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.waits: list[dict[str, Any]] = []
        self.monitor: LoadMonitor | None = None

    def quiet(self, label: str) -> None:
        if self.args.max_wait > 0:
            self.waits.append(wait_for_quiet(label, self.args.max_wait))

    def loaded(self, start: float | None, end: float | None) -> bool | None:
        return self.monitor.loaded(start, end) if self.monitor is not None else None

    def mark(self, run: dict[str, Any]) -> dict[str, Any]:
        run["under_load"] = self.loaded(run.get("started_at"), run.get("finished_at"))
        return run

    def rerun_loaded(self, runs: list[dict[str, Any]], rerun: Callable[[dict[str, Any]], dict[str, Any]],
                     label: str) -> list[dict[str, Any]]:
        """Once, after waiting for a quiet machine: re-run every run that shared the machine."""
        todo = [i for i, r in enumerate(runs) if r.get("under_load")]
        if not todo or not self.args.rerun_loaded:
            return runs
        self.quiet(f"{label}: re-running {len(todo)} runs that ran under load")
        for i in todo:
            runs[i] = {**self.mark(rerun(runs[i])), "rerun": True}
        print(f"[bench] {label}: re-ran {len(todo)} runs, {sum(bool(runs[i].get('under_load')) for i in todo)} "
              "still under load", flush=True)
        return runs


def _sweep_pp(ctx: Context, pp: int, microbatches: list[int], steps: int, *, model: Sequence[str] = SWEEP_MODEL,
              sweep: Path | None = None) -> list[dict[str, Any]]:
    """One Hydra multirun over schedules x m at this pp; any job the sweep did not leave (it stops
    on a launcher error) is re-run on its own."""
    sweep = sweep or ctx.work / f"efficiency-pp{pp}"
    common = _sweep_common(pp, steps, model)
    done = _runner(ctx, "-m", f"schedule={','.join(SCHEDULES)}",
                   f"parallel.microbatches={','.join(map(str, microbatches))}", *common, f"hydra.sweep.dir={sweep}")
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    jobs = [d for d in sweep.iterdir() if (d / ".hydra" / "overrides.yaml").is_file()] if sweep.is_dir() else []
    for job in jobs:
        o = _job_overrides(job)
        runs[(o["schedule"], int(o["parallel.microbatches"]))] = read_run(job, done)
    for name in SCHEDULES:
        for m in microbatches:
            if (name, m) not in runs or runs[(name, m)]["status"] == "running":
                runs[(name, m)] = _single_pp(ctx, pp, name, m, steps, sweep / f"single-{name}-m{m}", model)
    return [{"pp": pp, "schedule": name, "m": m, **runs[(name, m)]} for name in SCHEDULES for m in microbatches]


def _sweep_common(pp: int, steps: int, model: Sequence[str] = SWEEP_MODEL) -> list[str]:
    # Profiling off; the bubble is recorded over steps 1.. (profile.wait=1, warmup=0: no profiler to warm up).
    return [f"parallel.pp={pp}", f"train.steps={steps}", "profile.enabled=false", "profile.wait=1",
            "profile.warmup=0", f"profile.active={steps - 1}", *model]


def _single_pp(ctx: Context, pp: int, name: str, m: int, steps: int, run_dir: Path,
               model: Sequence[str] = SWEEP_MODEL) -> dict[str, Any]:
    """One efficiency run outside the sweep (a job the sweep did not leave, or a re-run)."""
    done = _runner(ctx, f"schedule={name}", f"parallel.microbatches={m}", *_sweep_common(pp, steps, model),
                   f"hydra.run.dir={run_dir}")
    return {"pp": pp, "schedule": name, "m": m, **read_run(run_dir, done)}


def efficiency(ctx: Context) -> dict[str, Any]:
    """Per pp, every schedule x m: tokens/s, step time, measured and theoretical bubble, memory."""
    a = ctx.args
    rows = []
    for i, pp in enumerate(a.pp):
        if i:
            ctx.quiet(f"efficiency pp={pp}")
        started = time.time()
        sweep = [ctx.mark(r) for r in _sweep_pp(ctx, pp, a.microbatches, a.steps)]
        rows += ctx.rerun_loaded(sweep, lambda r: _single_pp(
            ctx, r["pp"], r["schedule"], r["m"], a.steps, ctx.work / f"rerun-pp{r['pp']}-{r['schedule']}-m{r['m']}"),
            f"efficiency pp={pp}")
        print(f"[bench] efficiency pp={pp}: {time.time() - started:.0f} s", flush=True)
    return {"model": SWEEP_MODEL, "steps": a.steps, "pp": a.pp, "microbatches": a.microbatches, "runs": rows}


def activation_bytes_per_sample(overrides: Sequence[str], samples: int = 4) -> dict[str, float]:
    """Bytes each top-level model child keeps for backward, per sample: the storages autograd saves
    in its forward (parameters and storages already counted excluded), the loss's with the last."""
    import torch
    from hydra import compose, initialize_config_dir

    import runner.config  # noqa: F401
    from runner.losses import cross_entropy
    from runner.split import build_meta_model, materialize

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    meta = build_meta_model(cfg.model)
    model = materialize(meta, meta.unit_names, seed=0, device=torch.device("cpu"))
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randint(cfg.data.vocab_size, (samples, cfg.train.seq_len))
    targets = torch.randint(cfg.data.vocab_size, (samples, cfg.train.seq_len))
    out: dict[str, float] = {}
    names = meta.unit_names
    kept = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            kept["bytes"] += storage.nbytes()
        return t

    for i, name in enumerate(names):
        kept["bytes"] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = model.get_submodule(name)(x)
            if i == len(names) - 1:
                cross_entropy(x, targets)
        out[name] = kept["bytes"] / samples
    return out


def _efficiency_rows(ctx: Context) -> list[dict[str, Any]]:
    """The efficiency sweep's runs: from benchmarks/efficiency.json when it covers --pp and
    --microbatches, else the sweep is run (and efficiency.json refreshed)."""
    path = ctx.args.results / "efficiency.json"
    if path.is_file():
        data = json.loads(path.read_text())["results"]
        have = {(r["pp"], r["m"]) for r in data["runs"]}
        if all((pp, m) in have for pp in ctx.args.pp for m in ctx.args.microbatches):
            return [r for r in data["runs"] if r["pp"] in ctx.args.pp and r["m"] in ctx.args.microbatches]
    print("[bench] scaling: benchmarks/efficiency.json missing or partial; running the efficiency sweep", flush=True)
    ctx.quiet("scaling: efficiency sweep")
    results = efficiency(ctx)
    save(ctx.args.results, "efficiency", results, ctx, started=time.time(), duration_s=None)
    return results["runs"]


def scaling(ctx: Context) -> dict[str, Any]:
    """Step time over pp and m, and peak memory per rank against the activations each schedule's
    order keeps in flight (no runs of its own: the efficiency sweep's)."""
    from runner.plan import peak_in_flight, schedule_order
    from runner.schedule import is_single_stage

    runs = _efficiency_rows(ctx)
    per_sample = activation_bytes_per_sample(SWEEP_MODEL)
    batch = int(next(o for o in SWEEP_MODEL if o.startswith("train.batch_size=")).split("=")[1])
    rows = []
    for r in runs:
        spr = (r.get("num_stages") or 0) // r["pp"] or (1 if is_single_stage(r["schedule"]) else 2)
        row = {k: r.get(k) for k in ("pp", "schedule", "m", "status", "step_time_s", "tokens_per_s", "peak_mem_bytes",
                                     "under_load", "rerun") if k in r}
        row["stages_per_rank"] = spr
        try:
            order = schedule_order(r["schedule"], r["pp"], r["m"], spr)
        except Exception as e:  # an order torch refuses: recorded, not fatal
            row["order_error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            continue
        row["expected_in_flight"] = [peak_in_flight(order)[k] for k in sorted(order)]
        if r.get("stages"):
            stage_bytes = {int(s): sum(per_sample.get(n, 0.0) for n in names) * batch / r["m"]
                           for s, names in r["stages"].items()}
            peaks = peak_in_flight(order, stage_bytes)
            row["expected_activation_bytes"] = [round(peaks[k]) for k in sorted(order)]
        rows.append(row)
    return {"model": SWEEP_MODEL, "activation_bytes_per_sample": per_sample, "rows": rows}


def _option_run(ctx: Context, name: str, overrides: Sequence[str], repeat: int, steps: int,
                tag: str = "") -> dict[str, Any]:
    run_dir = ctx.work / f"option-{name}-{repeat}{tag}"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(ctx.work / f"inductor-{name}-{repeat}{tag}")}  # compile from cold each time
    done = _runner(ctx, *overrides, f"train.steps={steps}", "profile.enabled=false", *MODEL,
                   f"hydra.run.dir={run_dir}", env=env)
    run = read_run(run_dir, done)
    if run["status"] == "ok":
        times = run["step_times"]
        run.update(steady_s=steady(times, skip=2), first_step_s=times[0] if times else None,
                   second_step_s=times[1] if len(times) > 1 else None)
    return {"config": name, "repeat": repeat, "overrides": list(overrides), "steps": steps, **run}


def _option_runs(ctx: Context, table: Mapping[str, Sequence[str]], limits: Mapping[str, Mapping[str, int]],
                 label: str) -> list[dict[str, Any]]:
    """Every config of ``table`` once per repeat, the order reversed on odd repeats."""
    a = ctx.args
    runs = []
    for repeat in range(a.option_repeats):
        if repeat:
            ctx.quiet(f"{label} repeat {repeat}")
        names = list(table) if repeat % 2 == 0 else list(reversed(table))
        for name in names:
            limit = limits.get(name, {})
            if repeat >= limit.get("repeats", a.option_repeats):
                continue
            runs.append(ctx.mark(_option_run(ctx, name, table[name], repeat, limit.get("steps", a.option_steps))))
            r = runs[-1]
            print(f"[bench] {label} {name} #{repeat}: {r.get('steady_s') or r.get('error')}"
                  f"{' (under load)' if r.get('under_load') else ''}", flush=True)
    return ctx.rerun_loaded(
        runs, lambda r: _option_run(ctx, r["config"], r["overrides"], r["repeat"], r["steps"], "-rerun"), label)


def options(ctx: Context) -> dict[str, Any]:
    """Training options at pp=2 m=8."""
    table = {name: [*o, "parallel.pp=2", "parallel.microbatches=8"] for name, o in OPTIONS.items()}
    return {"model": MODEL, "pp": 2, "microbatches": 8, "steps": ctx.args.option_steps,
            "repeats": ctx.args.option_repeats, "limits": OPTION_LIMITS, "steady": "median step time from step 2 on",
            "runs": _option_runs(ctx, table, OPTION_LIMITS, "options")}


def single_device(ctx: Context) -> dict[str, Any]:
    """What one device measures on its own (a host with one GPU: NCCL cannot put two ranks on it):
    each stage's F/B/I/W time for the efficiency model split in 2 and in 4 stages, timed in one
    process as the planner times them, and pp=1 runs of the training options (steady step, peak
    memory: ``max_memory_allocated`` on a GPU, RSS on CPU)."""
    import torch
    from hydra import compose, initialize_config_dir

    import runner.config  # noqa: F401
    from runner.plan import measure_child_costs, stage_costs
    from runner.split import build_meta_model, plan_split

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(SWEEP_MODEL))
    device = torch.device("cuda", 0) if ctx.args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)  # as one rank of a CPU run
    microbatches = 8
    costs = measure_child_costs(cfg, cfg.train.batch_size // microbatches, 5, device)
    meta = build_meta_model(cfg.model)
    stages = []
    for num_stages in (2, 4):
        split = plan_split(meta, num_stages, None)
        fbiw = stage_costs(split, costs)
        for s, names in enumerate(split):
            stages.append({"num_stages": num_stages, "stage": s, "children": list(names),
                           **{f"{kind}_s": fbiw[(s, kind)] for kind in "FBIW"},
                           **{k: sum(getattr(costs[n], k) for n in names) for k in ("update_s", "saved_bytes")}})
    table = {name: [*o, "parallel.pp=1", f"parallel.microbatches={microbatches}"] for name, o in SINGLE.items()}
    limits = SINGLE_LIMITS if ctx.args.device == "cpu" else {}
    return {"model": SWEEP_MODEL, "microbatches": microbatches, "device_name": _device_name(ctx.args.device),
            "stages": stages, "options_model": MODEL, "steps": ctx.args.option_steps,
            "repeats": ctx.args.option_repeats, "limits": limits, "runs": _option_runs(ctx, table, limits, "device")}


def _step_times(run_dir: Path, skip: set[int]) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Steps are numbered from 1; the first includes shape inference.
    return [m["step_time_s"] for m in lines if m["step"] not in skip and m["step"] > 1]


def profiling(ctx: Context) -> dict[str, Any]:
    """Steady-state step time with profiling on (steps outside the window) / off, alternating."""
    common = ["schedule=1f1b", "parallel.microbatches=8", f"train.steps={ctx.args.profile_steps}", *MODEL]
    pairs = []
    for i in range(ctx.args.repeats):
        on, off = ctx.work / f"prof-on-{i}", ctx.work / f"prof-off-{i}"
        t0 = time.time()
        done_on = _runner(ctx, *common, "profile.enabled=true", f"hydra.run.dir={on}")
        done_off = _runner(ctx, *common, "profile.enabled=false", f"hydra.run.dir={off}")
        missing = [(d, done) for d, done in ((on, done_on), (off, done_off)) if not (d / "summary.json").is_file()]
        if missing:
            pairs.append({"error": _error(*missing[0])})
            continue
        window = set(json.loads((on / "summary.json").read_text())["bubble"]["steps"])
        window |= {min(window) - 1}  # the profiler's warm-up step
        on_s, off_s = statistics.median(_step_times(on, window)), statistics.median(_step_times(off, set()))
        pairs.append({"on_s": on_s, "off_s": off_s, "ratio": on_s / off_s, "under_load": ctx.loaded(t0, time.time())})
    return {"model": MODEL, "steps": ctx.args.profile_steps, "pairs": pairs}


_BARE = """
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r, store, start, out, cuda):
    if cuda:  # as the runner: NCCL, one GPU per rank
        torch.cuda.set_device(r)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, 2), rank=r, world_size=2,
                            device_id=torch.device("cuda", r) if cuda else None)
    dist.barrier()
    if r == 0:
        open(out, "w").write(str(time.time() - start))
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4] == "cuda"), nprocs=2)
"""


# Config errors the command line reports before importing torch: a misspelt key (Hydra's
# composition), a value the runner does not know, a combination it rejects.
CONFIG_ERRORS = {"misspelt key": ["trian.steps=5"], "unknown value": ["train.precision=fp16"],
                 "rejected combination": ["parallel.dp=2"]}


def _timed_error(ctx: Context, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Wall time of ``python -m runner <overrides>`` that must fail with a config error."""
    start = time.time()
    done = _runner(ctx, *overrides, f"hydra.run.dir={run_dir}")
    return {"s": time.time() - start, "returncode": done.returncode,
            "error": (done.stderr.strip().splitlines() or [""])[-1][:200]}


def startup(ctx: Context) -> dict[str, Any]:
    """Runner launch -> first step of experiment=smoke (and its phases, where the summary has
    them) against a bare spawn of 2 ranks -> process group up, and the time a config error takes
    to be reported, alternating."""
    work = ctx.work
    script = work / "bare_spawn.py"
    script.write_text(_BARE)
    pairs = []
    for i in range(ctx.args.repeats):
        run = work / f"smoke-{i}"
        t0 = time.time()
        done = _runner(ctx, "experiment=smoke", "profile.enabled=false", f"hydra.run.dir={run}")
        r = read_run(run, done)
        out = work / f"bare-{i}.txt"
        start = time.time()
        subprocess.run([sys.executable, str(script), str(work / f"store-{i}"), str(start), str(out), ctx.args.device],
                       check=False)
        bare = float(out.read_text()) if out.is_file() else None
        errors = {name: _timed_error(ctx, overrides, work / f"error-{i}-{n}")
                  for n, (name, overrides) in enumerate(CONFIG_ERRORS.items())}
        pairs.append({"runner_s": r.get("startup_s"), "phases_s": r.get("startup_phases_s"), "bare_s": bare,
                      "config_errors": errors, "error": r.get("error"), "under_load": ctx.loaded(t0, time.time())})
    return {"pairs": pairs}


_BARE_LOOP = """
import json, os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from runner.data import SyntheticData
from runner.losses import cross_entropy
from runner.split import build_meta_model, materialize, plan_split

def rank(r, cfg, store, out):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg)
    cuda = cfg.device == "cuda"  # as the runner: NCCL, one GPU per rank
    device = torch.device("cuda", r) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, 2), rank=r, world_size=2,
                            device_id=device if cuda else None)
    t, m = cfg.train, cfg.parallel.microbatches
    meta = build_meta_model(cfg.model)
    module = materialize(meta, plan_split(meta, 2, None)[r], seed=t.seed, device=device)
    schedule = Schedule1F1B(PipelineStage(module, r, 2, device), m, loss_fn=cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=t.lr)
    data = SyntheticData(vocab_size=cfg.data.vocab_size, signal=cfg.data.signal, seed=t.seed)
    times = []
    for step in range(t.steps):
        x, y = (b.to(device) for b in data.batch(step, t.batch_size, t.seq_len))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        schedule.step(x) if r == 0 else schedule.step(target=y)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if r == 0:
        open(out, "w").write(json.dumps(times))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]), nprocs=2)
"""


def overhead(ctx: Context) -> dict[str, Any]:
    """The runner's median steady-state step time over a bare loop's (same model, stages, data,
    schedule, 2 spawned ranks), alternating A/B."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import runner.config  # noqa: F401

    work = ctx.work
    overrides = ["schedule=1f1b", "parallel.microbatches=8", f"train.steps={ctx.args.overhead_steps}", *MODEL]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=[*overrides, f"device={ctx.args.device}"]),
                                     resolve=True)
    script = work / "bare_loop.py"
    script.write_text(_BARE_LOOP)
    pairs = []
    for i in range(ctx.args.repeats):
        run = work / f"overhead-runner-{i}"
        t0 = time.time()
        done = _runner(ctx, *overrides, "profile.enabled=false", "launch.threads_per_rank=1", f"hydra.run.dir={run}")
        out = work / f"overhead-bare-{i}.json"
        bare = subprocess.run([sys.executable, str(script), json.dumps(cfg), str(work / f"loop-store-{i}"), str(out)],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        if not (run / "metrics.jsonl").is_file() or not out.is_file():
            pairs.append({"error": _error(run, done) if not (run / "metrics.jsonl").is_file()
                          else (bare.stderr.strip().splitlines() or ["bare loop failed"])[-1][:300]})
            continue
        runner_s = statistics.median(_step_times(run, set()))
        bare_s = statistics.median(json.loads(out.read_text())[1:])
        pairs.append({"runner_s": runner_s, "bare_s": bare_s, "ratio": runner_s / bare_s,
                      "under_load": ctx.loaded(t0, time.time())})
    return {"model": MODEL, "steps": ctx.args.overhead_steps, "pairs": pairs}


def _ranks_agree(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Spearman's rank correlation of (predicted, measured) pairs (no ties expected)."""
    if len(pairs) < 3:
        return None

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0] * len(xs)
        for r, i in enumerate(order):
            out[i] = r
        return out
    rp, rm = ranks([p for p, _ in pairs]), ranks([m for _, m in pairs])
    n = len(pairs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rp, rm)) / (n * (n * n - 1))


def _label(c: Mapping[str, Any]) -> str:
    """A plan.json candidate as ``schedule/m`` (the key of a plain run), plus its stages per rank
    and split where they differ from a plain run's."""
    from runner.schedule import default_stages_per_rank

    name = c["schedule"] + (f"-{c['search']['placement']}" if c.get("search") else "")
    extra = "" if c["schedule"] == "synthesized" or c["stages_per_rank"] == default_stages_per_rank(c["schedule"]) \
        else f" v={c['stages_per_rank']}"
    return f"{name}/{c['microbatches']}{extra}" + (f" split {','.join(c['split_points'])}" if c.get("split_points")
                                                   else "")


def _plan(ctx: Context, out: Path, model: Sequence[str], microbatches: Sequence[int], *extra: str
          ) -> list[dict[str, Any]] | dict[str, Any]:
    """``python -m runner.plan`` at pp=2 (or ``extra``'s pp): its plan.json, or an error."""
    done = _runner(ctx, *model, "parallel.pp=2", f"plan.microbatches=[{','.join(map(str, microbatches))}]", *extra,
                   f"hydra.run.dir={out}", module="runner.plan")
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["plan failed"])[-1][:300]}
    return json.loads((out / "plan.json").read_text())


def _plan_round(ctx: Context, out: Path, microbatches: Sequence[int], model: Sequence[str] = MODEL) -> dict[str, Any]:
    from runner.schedule import default_stages_per_rank

    plan = _plan(ctx, out, model, microbatches)
    if "error" in plan:
        return plan
    # The candidates a plain run of each schedule uses (its default stages per rank and split).
    predicted = {f"{c['schedule']}/{c['microbatches']}": {
        "step_s": c["predicted_step_time_s"], "bubble": c["bubble"], "after_s": c.get("after_pipeline_s"),
        "costs": c.get("stage_costs_s")}
        for c in plan if c["valid"] and c["stages_per_rank"] == default_stages_per_rank(c["schedule"])
        and c.get("split_points") is None}
    recommended = next((c for c in plan if c.get("recommended")), None)
    return {"predicted": predicted, "calibration": json.loads((out / "calibration.json").read_text()),
            "recommended": None if recommended is None else _label(recommended),
            "tied": [_label(c) for c in plan if c.get("tie")]}


def _steady_s(run: Mapping[str, Any]) -> float | None:
    """A run's steady step time: the median over its last two thirds of steps. The first steps of a
    run are slower (1-3 ms actions: steps 2-5 measured x1.03-1.3 the later ones, with and without
    the profiler), and what the planner predicts is the steady state."""
    times = run.get("step_times") or []
    return steady(times, skip=max(1, len(times) // 3)) if len(times) > 3 else run.get("step_time_s")


def _planner_size(ctx: Context, name: str, model: Sequence[str], microbatches: list[int], steps: int
                  ) -> dict[str, Any]:
    rounds = []
    for r in range(ctx.args.planner_rounds):
        started = time.time()
        work = ctx.work / f"planner-{name}-{r}"
        plan = _plan_round(ctx, work / "plan", microbatches, model)
        if "error" in plan:
            return {"error": plan["error"]}
        runs = [ctx.mark(run) for run in _sweep_pp(ctx, 2, microbatches, steps, model=model, sweep=work / "runs")]
        measured = {f"{run['schedule']}/{run['m']}": {
            "step_s": _steady_s(run), "bubble": run.get("bubble"), "under_load": run.get("under_load"),
            "replayed_s": run.get("simulated_step_s"), "pipeline_s": run.get("pipeline_step_s"),
            "costs": run.get("mean_costs_s"),
            **({} if run["status"] == "ok" else {"error": run.get("error")})} for run in runs}
        rounds.append({**plan, "measured": measured})
        print(f"[bench] planner {name} round {r + 1}/{ctx.args.planner_rounds}: {time.time() - started:.0f} s",
              flush=True)
    return {"model": list(model), "pp": 2, "steps": steps, "microbatches": microbatches, "rounds": rounds}


def planner(ctx: Context) -> dict[str, Any]:
    """Per model size: rounds of ``python -m runner.plan`` at pp=2 (calibrated on this host, child
    costs timed in-process), then every schedule x m run for real. Rounds spread each schedule's
    runs over the section, so that a slow spell of this shared machine does not land on one
    schedule only."""
    a = ctx.args
    sizes = QUICK_SIZES if a.quick else {k: v for k, v in PLANNER_SIZES.items() if k in a.planner_sizes}
    out = {}
    for name, (model, microbatches, steps) in sizes.items():
        if name == "benchmark":
            microbatches = a.planner_microbatches or microbatches
        out[name] = _planner_size(ctx, name, model, microbatches, a.planner_steps or steps)
    return {"sizes": out}


def _synthesis_configs(plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest synthesized candidate that fits, then each built-in schedule's fastest (any
    microbatch count, stages per rank and split the plan tried)."""
    configs = []
    for name in ["synthesized", *SCHEDULES]:
        best = next((c for c in plan if c["schedule"] == name and c["valid"] and c["fits_memory"]), None)
        if best is not None:
            configs.append({"label": _label(best), "schedule": name, "overrides": best["overrides"],
                            "predicted_s": best["predicted_step_time_s"],
                            "peak_activation_bytes": max(best["peak_activation_bytes"])})
    return configs


def _synthesis_model(ctx: Context, name: str, model: Sequence[str], pp: int) -> dict[str, Any]:
    a = ctx.args
    work = ctx.work / f"synthesis-{name}-pp{pp}"
    microbatches = [2, 4] if a.quick else [4, 8]
    plan = _plan(ctx, work / "plan", model, microbatches, f"parallel.pp={pp}", "plan.synthesize=true")
    if "error" in plan:
        return {"error": plan["error"]}
    configs = _synthesis_configs(plan)
    if not configs or configs[0]["schedule"] != "synthesized":
        return {"error": "the plan has no synthesized candidate that fits", "configs": configs}
    common = [*model, f"parallel.pp={pp}", f"train.steps={a.synthesis_steps}", "profile.enabled=false",
              "profile.wait=1", "profile.warmup=0", f"profile.active={a.synthesis_steps - 1}"]
    for r in range(a.synthesis_rounds):
        # Alternating: every config once per round, the order rotated so none always runs first.
        for i in range(len(configs)):
            config = configs[(i + r) % len(configs)]
            run_dir = work / f"round{r}" / config["label"].replace("/", "-").replace(" ", "_")
            done = _runner(ctx, *common, *config["overrides"], f"hydra.run.dir={run_dir}")
            run = ctx.mark(read_run(run_dir, done))
            config.setdefault("runs", []).append({**run, "steady_s": _steady_s(run)})
        print(f"[bench] synthesis {name} pp={pp} round {r + 1}/{a.synthesis_rounds}", flush=True)
    return {"model": list(model), "pp": pp, "steps": a.synthesis_steps, "microbatches": microbatches,
            "configs": configs}


def synthesis(ctx: Context) -> dict[str, Any]:
    """``python -m runner.plan plan.synthesize=true`` on a model with a heavy last stage and one with
    equal stages, at pp=2 (and pp=4 on a host with 4 cores or more), then the fastest synthesized
    schedule against every built-in schedule's best plan, in alternating runs."""
    models = QUICK_SYNTH if ctx.args.quick else SYNTH_MODELS
    pps = [2] + ([4] if (os.cpu_count() or 1) >= 4 and not ctx.args.quick else [])
    return {"cases": [{"name": name, **_synthesis_model(ctx, name, model, pp)}
                      for name, model in models.items() for pp in pps]}


def hf_models(ctx: Context) -> dict[str, Any]:
    """``model=hf``: a Llama-shaped model read from its directory's safetensors, pipelined at pp=2
    (1F1B, ZBV) against its unsplit run in alternating order: step time, peak memory per rank, and
    the bytes each rank read of the weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    model_dir = ctx.work / "hf-llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**HF_LLAMA)).save_pretrained(model_dir)
    file_bytes = sum(p.numel() * p.element_size()
                     for p in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().values())
    common = ["model=hf", f"model.path={model_dir}", f"data.vocab_size={HF_LLAMA['vocab_size']}",
              "train.seq_len=128", "train.batch_size=32", "parallel.microbatches=8", "profile.enabled=false",
              f"train.steps={ctx.args.option_steps}"]
    runs = []
    for repeat in range(ctx.args.option_repeats):
        for name in HF_RUNS if repeat % 2 == 0 else reversed(HF_RUNS):
            run_dir = ctx.work / f"hf-{name}-{repeat}"
            run = read_run(run_dir, _runner(ctx, *common, *HF_RUNS[name], f"hydra.run.dir={run_dir}"))
            if run["status"] == "ok":
                run["steady_s"] = steady(run["step_times"], skip=2)
            runs.append(ctx.mark({"config": name, "repeat": repeat, **run}))
            print(f"[bench] hf {name} #{repeat}: {run.get('steady_s') or run.get('error')}", flush=True)
    return {"model": HF_LLAMA, "file_bytes": file_bytes, "overrides": common, "runs": runs}


RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "efficiency": efficiency, "scaling": scaling, "options": options, "overhead": overhead, "startup": startup,
    "profiling": profiling, "planner": planner, "synthesis": synthesis, "device": single_device, "hf": hf_models,
}


def ranks_needed(section: str, args: argparse.Namespace) -> int:
    """Ranks a section runs at once: with --device cuda, one GPU each."""
    return {"device": 1, "efficiency": max(args.pp), "scaling": max(args.pp)}.get(section, 2)


def save(results_dir: Path, section: str, results: dict[str, Any], ctx: Context, *, started: float,
         duration_s: float | None, load: dict[str, Any] | None = None) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    meta = {"section": section, "machine": machine(ctx.args.device),
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
            "command": "python scripts/bench.py " + " ".join(sys.argv[1:]), "duration_s": duration_s,
            "waits": ctx.waits, "load": load}
    path = results_dir / f"{section}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def run_section(section: str, ctx: Context) -> None:
    if ctx.args.device == "cuda":
        import torch

        need, have = ranks_needed(section, ctx.args), torch.cuda.device_count()
        if have < need:  # its JSON (an earlier run on more GPUs) stays as it is
            print(f"[bench] {section}: skipped, it needs {need} GPUs (NCCL puts one rank on each) and this host "
                  f"has {have}", flush=True)
            return
    ctx.waits = []
    if section != "scaling":  # scaling times nothing of its own (unless it has to run the sweep: it waits then)
        ctx.quiet(section)
    started = time.time()
    print(f"[bench] {section}: started {time.strftime('%H:%M:%S')}", flush=True)
    with LoadMonitor() as monitor:
        ctx.monitor = monitor
        try:
            results = RUNNERS[section](ctx)
        finally:
            ctx.monitor = None
    duration = time.time() - started
    path = save(ctx.args.results, section, results, ctx, started=started, duration_s=round(duration, 1),
                load=monitor.report)
    print(f"[bench] {section}: {duration:.0f} s -> {path}", flush=True)


# ---------------------------------------------------------------------------------------------
# Rendering: BENCHMARKS.md and the bubble plot from benchmarks/*.json


def _num(x: Any, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


def _meta_line(meta: Mapping[str, Any], runs: Sequence[Mapping[str, Any]] | None = None) -> str:
    """When, how long, the command, and how loaded the machine was: over the whole section, and
    (``runs`` with ``under_load``/``rerun`` flags) for the runs whose numbers are kept."""
    dur = meta.get("duration_s")
    waits = meta.get("waits") or []
    waited = sum(w.get("waited_s", 0) for w in waits)
    load = meta.get("load") or {}
    parts = [f"Ran {meta.get('date', '?')}"
             + (f", {dur / 60:.1f} min" if dur is not None else "")
             + (f" (waits for a quiet machine before and within it: {waited / 60:.1f} min)" if waited >= 60 else ""),
             f"`{meta.get('command', '')}`"]
    m = meta.get("machine") or {}
    if m:
        parts.append(f"torch {m.get('torch')}, {m.get('cores')} cores")
    share = load.get("foreign_cpu_share")
    section = ", ".join(filter(None, [
        f"other processes used {share:.0%} of the CPU over the section" if share is not None else "",
        f"pytest seen in {load['pytest_samples']} of {load.get('samples')} samples" if load.get("pytest_samples")
        else "",
        "the machine was still busy when a wait ran out" if any(not w.get("quiet", True) for w in waits) else ""]))
    flagged = [r for r in runs or [] if "under_load" in r]
    if flagged:
        reran = sum(bool(r.get("rerun")) for r in flagged)
        still = sum(bool(r.get("under_load")) for r in flagged)
        kept = (f"**{still} of {len(flagged)} kept results ran under load** (marked *)" if still
                else f"none of the {len(flagged)} kept results shared the machine")
        parts.append(kept + (f", after re-running {reran} that had" if reran else "") + (f"; {section}" if section
                                                                                          else ""))
    elif section:
        heavy = bool(load.get("pytest_samples")) or (share or 0) > 0.1 or any(not w.get("quiet", True) for w in waits)
        parts.append(("**ran under load**: " if heavy else "quiet machine: ") + section)
    return "_" + "; ".join(parts) + "._"


def _star(run: Mapping[str, Any]) -> str:
    return "*" if run.get("under_load") else ""


def _forward_ms(run: Mapping[str, Any]) -> tuple[float, float] | None:
    fwd = [v for k, v in (run.get("mean_costs_s") or {}).items() if k.endswith("F")]
    return (min(fwd) * 1e3, max(fwd) * 1e3) if fwd else None


def _find(runs: Iterable[Mapping[str, Any]], **keys: Any) -> Mapping[str, Any] | None:
    return next((r for r in runs if all(r.get(k) == v for k, v in keys.items()) and r.get("status") == "ok"), None)


def _once(seen: set[str], label: str) -> str | None:
    """A legend label the first time it is asked for, then None."""
    if label in seen:
        return None
    seen.add(label)
    return label


def plot_bubbles(runs: Sequence[Mapping[str, Any]], path: Path) -> bool:
    """Measured bubble (bars) and theoretical (black ticks) per schedule and m, one panel per pp."""
    ok = [r for r in runs if r.get("status") == "ok" and r.get("bubble") is not None]
    if not ok:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pps = sorted({r["pp"] for r in ok})
    ms = sorted({r["m"] for r in ok})
    colors = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    fig, axes = plt.subplots(len(pps), 1, figsize=(11, 3.6 * len(pps)), squeeze=False)
    width = 0.8 / len(ms)
    for ax, pp in zip(axes[:, 0], pps):
        labelled: set[str] = set()
        for j, m in enumerate(ms):
            for i, name in enumerate(SCHEDULES):
                r = _find(ok, pp=pp, schedule=name, m=m)
                if r is None:
                    continue
                x = i - 0.4 + width * (j + 0.5)
                ax.bar(x, r["bubble"], width=width * 0.9, color=colors[j % len(colors)],
                       label=_once(labelled, f"measured, m={m}"))
                if r.get("bubble_theoretical") is not None:
                    ax.hlines(r["bubble_theoretical"], x - width * 0.45, x + width * 0.45, colors="black",
                              linewidth=2, label=_once(labelled, "theoretical"))
        ax.set_xticks(range(len(SCHEDULES)), SCHEDULES, fontsize=8)
        ax.set_ylabel("bubble fraction")
        ax.set_title(f"pp={pp}" + (" (4 ranks on 2 cores: oversubscribed)" if pp > (os.cpu_count() or 1) else ""),
                     fontsize=10)
        ax.legend(fontsize=7, ncol=len(ms) + 1)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Measured (bars) vs theoretical (black ticks) pipeline bubble", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _render_efficiency(data: Mapping[str, Any], out_dir: Path, plot_path: Path) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    lines = ["## Pipeline efficiency: measured vs theoretical bubble", "", _meta_line(data["meta"], runs), "",
             "Model: transformer, `" + " ".join(res.get("model", [])) + f"`, {res.get('steps')} steps per run "
             "(one Hydra multirun per pp over schedule x m, profiling off). Bubble = 1 - (time in the stage's own "
             "compute calls) / (pipeline-step wall time), mean over ranks and steps 1 on; theoretical: the "
             "closed form for GPipe/1F1B/interleaved/looped BFS (`f`), else the simulator with the measured costs "
             "(`sim`). Step time: median after step 0. pp=4 puts 4 ranks on 2 cores, so ranks wait for a core as "
             "well as for each other (and its compute times include that wait): it is reported, but bubbles are "
             "judged at pp=2. The pipeline-step wall time is the same for every rank: from the first rank's start "
             "to the last rank's end, so a rank that returns early (the last rank of GPipe/1F1B) counts the "
             "drain as idle, as the closed forms do.", ""]
    fwd = [_forward_ms(r) for r in runs if r.get("status") == "ok"]
    fwd_pp2 = [_forward_ms(r) for r in runs if r.get("status") == "ok" and r["pp"] == 2]
    if any(fwd):
        lo = min(f[0] for f in fwd if f)
        lines += ["Measured forward time of one microbatch on one stage (`bubble.mean_costs_s`): "
                  + (f"{min(f[0] for f in fwd_pp2 if f):.0f}-{max(f[1] for f in fwd_pp2 if f):.0f} ms at pp=2, "
                     if any(fwd_pp2) else "")
                  + f"at least {lo:.0f} ms in every run (column `fwd ms`, min-max over stages); a message is one "
                  "microbatch's activations over loopback gloo (at most 1 MiB), well under a millisecond.", ""]
    if plot_bubbles(runs, plot_path):
        rel = os.path.relpath(plot_path, out_dir)
        lines += [f"![measured vs theoretical bubble]({rel})", ""]
    headlines = _efficiency_headlines(runs)
    if headlines:
        lines += headlines + [""]
    lines += ["| pp | schedule | m | tokens/s | step time (s) | fwd ms | bubble measured | per rank | theoretical | "
              "measured - theory | peak RSS MiB (max rank) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.get("status") != "ok":
            lines.append(f"| {r['pp']} | {r['schedule']}{_star(r)} | {r['m']} | failed: {r.get('error', '')} "
                         "| | | | | | | |")
            continue
        f = _forward_ms(r)
        gap = (r["bubble"] - r["bubble_theoretical"]) if r.get("bubble") is not None and \
            r.get("bubble_theoretical") is not None else None
        src = {"formula": "f", "simulated with measured costs": "sim"}.get(r.get("theoretical_source"), "")
        mem = max(r["peak_mem_bytes"]) / MIB if r.get("peak_mem_bytes") else None
        lines.append(f"| {r['pp']} | {r['schedule']}{_star(r)} | {r['m']} | {_num(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_num(r.get('step_time_s'))} | {f'{f[0]:.0f}-{f[1]:.0f}' if f else ''} | "
                     f"{_num(r.get('bubble'))} | {'/'.join(_num(b, '.2f') for b in r.get('bubble_per_rank') or [])} | "
                     f"{_num(r.get('bubble_theoretical'))} {src} | {_num(gap, '+.3f')} | "
                     f"{_num(mem, '.0f')} |")
    return lines + [""]


def _efficiency_headlines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    gaps = []
    for name in ["gpipe", "1f1b", "interleaved_1f1b"]:
        r = _find(runs, pp=2, m=8, schedule=name)
        if r and r.get("bubble") is not None and r.get("bubble_theoretical") is not None:
            gaps.append(f"{name} {r['bubble']:.3f} vs {r['bubble_theoretical']:.3f} "
                        f"({r['bubble'] - r['bubble_theoretical']:+.3f})")
    if gaps:
        out.append("- pp=2, m=8, measured vs theoretical bubble: " + "; ".join(gaps) + ".")
    base = _find(runs, pp=2, m=8, schedule="1f1b")
    zb = []
    for name in ZERO_BUBBLE:
        r = _find(runs, pp=2, m=8, schedule=name)
        if r and base and r.get("step_time_s") and base.get("step_time_s"):
            zb.append(f"{name} step time x{r['step_time_s'] / base['step_time_s']:.3f}, bubble "
                      f"{_num(r.get('bubble'))} (theory {_num(r.get('bubble_theoretical'))})")
    if zb:
        out.append(f"- Zero-bubble schedules against 1F1B at pp=2, m=8 (1F1B: bubble {_num(base.get('bubble'))}, "
                   f"{_num(base.get('step_time_s'))} s/step): " + "; ".join(zb) + ".")
    return out


def _render_scaling(data: Mapping[str, Any]) -> list[str]:
    res = data["results"]
    rows = res.get("rows", [])
    lines = ["## Scaling: step time and memory over pp and m", "", _meta_line(data["meta"]), "",
             "From the efficiency sweep's runs (same model, same invocation: no runs of its own; * marks a run "
             "that shared the machine, as in the efficiency table). The total work per "
             "step is fixed (64 samples), so with perfect scaling the step time would fall as 1/pp on enough cores; "
             "on 2 cores pp=4 cannot be faster than pp=2.", "", "### Step time (s)", ""]
    keys = sorted({(r["pp"], r["m"]) for r in rows})
    lines += ["| schedule | " + " | ".join(f"pp={pp} m={m}" for pp, m in keys) + " |",
              "|---|" + "---|" * len(keys)]
    for name in SCHEDULES:
        cells = []
        for pp, m in keys:
            r = next((x for x in rows if x["schedule"] == name and x["pp"] == pp and x["m"] == m), None)
            cells.append(_num(r.get("step_time_s")) + _star(r) if r and r.get("status") == "ok"
                         else "failed" if r else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "### Peak memory per rank against activations in flight", "",
              "Expected in flight: per rank, the most stage-microbatches whose forward has run and whose activations "
              "are not yet freed, walking the rank's op order from `runner.plan.schedule_order` (freed by B, or by W "
              "for schedules that split backward into I and W: an upper bound there, as I may free part of them). "
              "Interleaved and V schedules count stages of half the size, so the expected activation MiB (each "
              "stage's saved-for-backward bytes per microbatch, measured in-process from autograd's saved tensors, "
              "times the order's peak) is the comparable column. Measured: the rank's peak RSS (`ru_maxrss`), which "
              "also holds the Python process, torch, the stage's parameters, gradients and AdamW state, and whatever "
              "the allocator keeps: coarse on CPU. Compare schedules at the same pp and m, and the fit below.", ""]
    per_sample = res.get("activation_bytes_per_sample") or {}
    if per_sample:
        total = sum(per_sample.values())
        lines += [f"Saved for backward: {total / MIB:.1f} MiB per sample through the whole model "
                  f"({', '.join(f'{k} {v / MIB:.2f}' for k, v in per_sample.items())} MiB).", ""]
    for pp in sorted({r["pp"] for r in rows}):
        pts = [(e, p) for r in rows if r["pp"] == pp and r.get("status") == "ok" and r.get("peak_mem_bytes")
               and r.get("expected_activation_bytes")
               for e, p in zip(r["expected_activation_bytes"], r["peak_mem_bytes"])]
        fit = linear_fit([e / MIB for e, _ in pts], [p / MIB for _, p in pts])
        if fit:
            a, b, rr = fit
            lines.append(f"- pp={pp}: peak RSS ≈ {a:.0f} MiB + {b:.2f} x expected activations (r = {rr:.2f}, "
                         f"{len(pts)} rank-runs).")
    lines += ["", "| pp | m | schedule | expected in flight (stage-mb per rank) | expected activations MiB per rank | "
              "peak RSS MiB per rank |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda x: (x["pp"], x["m"], SCHEDULES.index(x["schedule"])
                                         if x["schedule"] in SCHEDULES else 99)):
        counts = " / ".join(str(c) for c in r.get("expected_in_flight") or []) or r.get("order_error", "")
        act = " / ".join(f"{b / MIB:.0f}" for b in r.get("expected_activation_bytes") or [])
        rss = " / ".join(f"{b / MIB:.0f}" for b in r.get("peak_mem_bytes") or []) if r.get("status") == "ok" \
            else "failed"
        lines.append(f"| {r['pp']} | {r['m']} | {r['schedule']}{_star(r)} | {counts} | {act} | {rss} |")
    return lines + [""]


def _option_table(runs: Sequence[Mapping[str, Any]], names: Iterable[str],
                  ratio_specs: Sequence[tuple[str, str, str]]) -> tuple[list[str], dict[str, list[float]]]:
    ratios: dict[str, list[float]] = {}
    repeats = sorted({r["repeat"] for r in runs})
    for label, cfg, base in ratio_specs:
        for rep in repeats:
            a = _find(runs, config=cfg, repeat=rep)
            b = _find(runs, config=base, repeat=rep)
            if a and b and a.get("steady_s") and b.get("steady_s"):
                ratios.setdefault(label, []).append(a["steady_s"] / b["steady_s"])
    lines = ["| config | overrides | steady step (s) per repeat | step 0 (s) | step 1 (s) | peak memory MiB (max "
             "rank) |",
             "|---|---|---|---|---|---|"]
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        if not mine:
            continue
        ok = [r for r in mine if r.get("status") == "ok"]
        overrides = " ".join(mine[0].get("overrides", []))
        if not ok:
            lines.append(f"| {name} | `{overrides}` | failed: {mine[0].get('error', '')} | | | |")
            continue
        mem = max(max(r["peak_mem_bytes"]) for r in ok if r.get("peak_mem_bytes")) / MIB
        steady_s = ", ".join(_num(r.get("steady_s")) + _star(r) for r in ok)
        lines.append(f"| {name} | `{overrides}` | {steady_s} | "
                     f"{', '.join(_num(r.get('first_step_s'), '.2f') for r in ok)} | "
                     f"{', '.join(_num(r.get('second_step_s'), '.2f') for r in ok)} | {mem:.0f} |")
    return lines, ratios


def _render_options(data: Mapping[str, Any]) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    table, ratios = _option_table(runs, OPTIONS, OPTION_RATIOS)
    lines = ["## Training options: cost at pp=2, m=8", "", _meta_line(data["meta"], runs), "",
             "Model `" + " ".join(res.get("model", [])) + f"`, {res.get('steps')} steps, profiling off; every config "
             f"once per repeat ({res.get('repeats')} repeats, order reversed on odd repeats). Steady = median step "
             "time from step 2 on; a ratio divides a config's steady step by its baseline's in the same repeat. "
             "Compiled runs start from an empty inductor cache (`TORCHINDUCTOR_CACHE_DIR` per run), so step 0 holds "
             "the whole cold compile."
             + "".join(f" `{n}`: {lim.get('steps')} steps, {lim.get('repeats')} repeat(s) only (bf16 matmuls are "
                       "several times slower than fp32 on a CPU without native bf16)."
                       for n, lim in (res.get("limits") or {}).items()),
             ""]
    return lines + _ratio_table(ratios, OPTION_RATIOS) + ["", *table, ""]


def _ratio_table(ratios: Mapping[str, list[float]], specs: Sequence[tuple[str, str, str]]) -> list[str]:
    lines = ["| ratio | per repeat | median |", "|---|---|---|"]
    for label, _, _ in specs:
        vals = ratios.get(label)
        lines.append(f"| {label} | {', '.join(f'{v:.3f}' for v in vals) if vals else 'n/a'} | "
                     f"{_num(statistics.median(vals)) if vals else ''} |")
    return lines


def _render_device(data: Mapping[str, Any]) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    lines = [f"## One device ({res['device_name']}): per-stage costs and the options at pp=1", "",
             _meta_line(data["meta"], runs), "",
             "Each stage of the efficiency model (`" + " ".join(res["model"]) + f"`) on one microbatch (m="
             f"{res['microbatches']}), split in 2 and in 4 stages, timed in one process as `python -m runner.plan` "
             "times it (median of 5): forward, full backward, and the zero-bubble split of it as torch's stages "
             "run it, input backward (I) then weight backward (W; the first stage's input takes no gradient, so "
             "its W is the whole backward), the optimizer update of its parameters, and the activations its "
             "forward saves.", "",
             "| stages | stage | children | F (ms) | B (ms) | I (ms) | W (ms) | update (ms) | saved (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for st in res["stages"]:
        f, b, i, w = (st[f"{kind}_s"] * 1e3 for kind in "FBIW")
        lines.append(f"| {st['num_stages']} | {st['stage']} | {', '.join(st['children'])} | {f:.1f} | {b:.1f} | "
                     f"{i:.1f} | {w:.1f} | {st['update_s'] * 1e3:.1f} | {st['saved_bytes'] / MIB:.1f} |")
    table, ratios = _option_table(runs, SINGLE, SINGLE_RATIOS)
    lines += ["", "The training options on the unsplit model (`parallel.pp=1`, m=8, model `"
              + " ".join(res["options_model"]) + f"`), {res['steps']} steps, profiling off, "
              f"{res['repeats']} repeats (order reversed on odd repeats); steady = median step from step 2 on; "
              "peak memory is `torch.cuda.max_memory_allocated` on a GPU, RSS on CPU."
              + "".join(f" `{n}`: {lim.get('steps')} steps, {lim.get('repeats')} repeat(s) only."
                        for n, lim in (res.get("limits") or {}).items()), ""]
    return lines + _ratio_table(ratios, SINGLE_RATIOS) + ["", *table, ""]


def _ratios_line(pairs: Sequence[Mapping[str, Any]]) -> str:
    vals = [p["ratio"] for p in pairs if p.get("ratio") is not None]
    errors = [p["error"] for p in pairs if p.get("error")]
    text = ", ".join(f"{p['ratio']:.3f}{_star(p)}" for p in pairs if p.get("ratio") is not None)
    if vals:
        text += f" (median {statistics.median(vals):.3f}, min {min(vals):.3f}, max {max(vals):.3f})"
    if errors:
        text += f"; {len(errors)} failed: {errors[0]}"
    return text or "no result"


def _render_overhead(data: Mapping[str, Any]) -> list[str]:
    res = data["results"]
    return ["## Runner overhead", "", _meta_line(data["meta"], res.get("pairs")), "",
            "Median steady-state step time of the runner (1F1B, pp=2, m=8, profiling off, `"
            + " ".join(res.get("model", [])) + "`; its step adds the global-norm clip and the loss all-reduce) over a "
            "minimal hand-written loop that builds the same stages and calls `Schedule1F1B.step()` and AdamW, "
            "alternating runs: " + _ratios_line(res.get("pairs", [])), ""]


def _render_startup(data: Mapping[str, Any]) -> list[str]:
    pairs = data["results"].get("pairs", [])
    lines = ["## Startup", "", _meta_line(data["meta"], pairs), "",
             "`experiment=smoke` from launch (before Python imports torch) until its first step starts (summary "
             "`startup_s`: compose, imports, validate, spawn 2 ranks, process group, build) against a bare spawn of "
             "2 ranks that import torch and initialise a gloo group, alternating; where the summary has "
             "`startup_phases_s` (which runs on to the end of the first step, shape inference included), its total "
             "too:", "",
             "| runner to first step (s) | runner to end of the first step (s) | bare spawn (s) "
             "| ratio (first step / bare) |",
             "|---|---|---|---|"]
    for p in pairs:
        a, b = p.get("runner_s"), p.get("bare_s")
        to_end = sum(p["phases_s"].values()) if isinstance(p.get("phases_s"), dict) and p["phases_s"] else None
        if a is None or b is None:
            lines.append(f"| failed: {p.get('error') or 'no number'} | | {_num(b, '.2f')} | |")
        else:
            lines.append(f"| {a:.2f}{_star(p)} | {_num(to_end, '.2f')} | {b:.2f} | {a / b:.2f} |")
    phased = [p["phases_s"] for p in pairs if isinstance(p.get("phases_s"), dict) and p["phases_s"]]
    if phased:
        names: list[str] = []
        for ph in phased:
            names += [n for n in ph if n not in names]
        means = {n: statistics.fmean(ph[n] for ph in phased if n in ph) for n in names}
        total = sum(means.values())
        lines += ["", f"The runner's startup by phase (`startup_phases_s`, mean over {len(phased)} runs):", "",
                  "| phase | mean (s) | share |", "|---|---|---|"]
        lines += [f"| {n} | {means[n]:.2f} | {means[n] / total:.0%} |" if total else f"| {n} | {means[n]:.2f} | |"
                  for n in names]
        lines.append(f"| total | {total:.2f} | |")
    else:
        lines += ["", "No per-phase split: these runs' summary.json has no `startup_phases_s`."]
    return lines + _render_config_errors(pairs) + [""]


def _render_config_errors(pairs: list[Mapping[str, Any]]) -> list[str]:
    """Launch to exit of a command line with a config error (no torch imported before it is found)."""
    timed = [p["config_errors"] for p in pairs if p.get("config_errors")]
    if not timed:
        return ["", "No config-error timings in these results (added later to the section)."]
    lines = ["", "A config error, from launch to the exit with its message (the checks that need no torch run before "
             "torch is imported), next to the bare spawn above:", "",
             "| error | overrides | exit status | time (s), per run | median (s) |", "|---|---|---|---|---|"]
    for name, overrides in CONFIG_ERRORS.items():
        runs = [t[name] for t in timed if name in t]
        codes = sorted({r["returncode"] for r in runs})
        times = [r["s"] for r in runs]
        lines.append(f"| {name} | `{' '.join(overrides)}` | {', '.join(map(str, codes))} | "
                     f"{', '.join(f'{x:.2f}' for x in times)} | {statistics.median(times):.2f} |")
    return lines


def _render_profiling(data: Mapping[str, Any]) -> list[str]:
    res = data["results"]
    return ["## Profiling cost", "", _meta_line(data["meta"], res.get("pairs")), "",
            "Median steady-state step time with `profile.enabled=true`, outside the profiled window, over the same "
            "with profiling off (1F1B, pp=2, m=8, " + f"{res.get('steps')} steps), alternating runs: "
            + _ratios_line(res.get("pairs", [])), ""]


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _planner_rows(res: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per (schedule, m): the medians over rounds of predicted and measured step times, the
    measured range, and the replay of each run's own costs."""
    rows = []
    for name in SCHEDULES:
        for m in res["microbatches"]:
            key = f"{name}/{m}"
            pred = [r["predicted"][key] for r in res["rounds"] if key in r["predicted"]]
            meas = [r["measured"][key] for r in res["rounds"] if (r["measured"].get(key) or {}).get("step_s")]
            if not pred or not meas:
                continue
            steps = [x["step_s"] for x in meas]
            replayed = [x["replayed_s"] / x["step_s"] for x in meas if x.get("replayed_s")]
            rows.append({"schedule": name, "m": m, "predicted_s": statistics.median(x["step_s"] for x in pred),
                         "measured_s": statistics.median(steps), "measured_min": min(steps),
                         "measured_max": max(steps),
                         "predicted_bubble": statistics.median(x["bubble"] for x in pred),
                         "measured_bubble": _median([x["bubble"] for x in meas if x.get("bubble") is not None]),
                         "replayed": _median(replayed)})
    return rows


def _separated_pairs(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int, list[str]]:
    """Pairs of schedules whose measured ranges over the rounds do not overlap, and how many of
    them the prediction orders the same way (with the ones it does not)."""
    agree, total, wrong = 0, 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            fast, slow = (a, b) if a["measured_max"] < b["measured_min"] else (b, a)
            if fast["measured_max"] >= slow["measured_min"]:
                continue  # within the run-to-run spread: no measured order to hold the planner to
            total += 1
            if fast["predicted_s"] < slow["predicted_s"]:
                agree += 1
            else:
                wrong.append(f"{fast['schedule']} < {slow['schedule']}")
    return agree, total, wrong


def _ratio_median(pairs: Iterable[tuple[float | None, float | None]]) -> float | None:
    return _median([p / m for p, m in pairs if p is not None and m])


def _attribution(res: Mapping[str, Any]) -> dict[str, Any]:
    """Where a size's error sits, as medians over every (round, configuration): the predicted
    pipeline over the run's ``pipeline_step_s``, the predicted rest of the step (all-reduce, clip,
    optimizer) over the run's, and each recorded action's mean cost over the planned one, forwards
    apart from backwards (B, I and W)."""
    pipe, after, cost = [], [], {"F": [], "B": []}
    for r in res["rounds"]:
        for key, p in r["predicted"].items():
            m = r["measured"].get(key) or {}
            if not m.get("step_s") or p.get("after_s") is None:
                continue
            if m.get("pipeline_s"):
                pipe.append((p["step_s"] - p["after_s"], m["pipeline_s"]))
                after.append((p["after_s"], m["step_s"] - m["pipeline_s"]))
            for action, seconds in (m.get("costs") or {}).items():
                planned = (p.get("costs") or {}).get(action)
                if planned:
                    cost["F" if action.endswith("F") else "B"].append((seconds, planned))
    return {"pipeline": _ratio_median(pipe), "after": _ratio_median(after),
            "cost_f": _ratio_median(cost["F"]), "cost_b": _ratio_median(cost["B"])}


def _recommendations(res: Mapping[str, Any]) -> str:
    """The recommended candidate of each round, with how many rounds named it and declared a tie."""
    picks: dict[str, list[bool]] = {}
    for r in res["rounds"]:
        if r.get("recommended"):
            picks.setdefault(r["recommended"], []).append(bool(r.get("tied")))
    if not picks:
        return "not recorded"
    return ", ".join(f"{label} x{len(ties)}" + (f" ({sum(ties)} as a tie)" if any(ties) else "")
                     for label, ties in sorted(picks.items(), key=lambda kv: -len(kv[1])))


def _planner_summary(sizes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = ["| size | model | median F (ms) | within 10% | median error | bias (median signed) | pipeline "
             "predicted / measured | rest of step predicted / measured | action cost run / planned, F | B | "
             "recommended per round |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in sizes.items():
        if "error" in res:
            lines.append(f"| {name} | failed: {res['error']} |||||||||")
            continue
        rows = _planner_rows(res)
        errors = [r["predicted_s"] / r["measured_s"] - 1 for r in rows]
        forwards = [v for r in res["rounds"] for m in r["measured"].values() for k, v in (m.get("costs") or {}).items()
                    if k.endswith("F")]
        att = _attribution(res)
        forward_ms = _median(forwards) * 1e3 if forwards else None
        lines.append(f"| {name} | `{' '.join(res['model'])}` | {_num(forward_ms, '.2f')}"
                     f" | {sum(abs(e) <= 0.10 for e in errors)} of {len(errors)} | "
                     f"{_num(_median([abs(e) for e in errors]), '.1%')} | {_num(_median(errors), '+.1%')} | "
                     f"{_num(att['pipeline'])} | {_num(att['after'])} | {_num(att['cost_f'])} | "
                     f"{_num(att['cost_b'])} | {_recommendations(res)} |")
    return lines + [""]


def _render_planner(data: Mapping[str, Any]) -> list[str]:
    res = data["results"]
    lines = ["## Planner: predicted vs measured", "", _meta_line(data["meta"]), ""]
    if "error" in res:
        return lines + [f"The planner failed: {res['error']}", ""]
    sizes = res["sizes"] if "sizes" in res else {"benchmark": res}  # results from before the sizes
    if len(sizes) > 1:
        lines += ["Per model size (pp=2; medians over rounds and configurations). *Pipeline* compares the predicted "
                  "pipeline with the run's `pipeline_step_s`, *rest of step* the predicted all-reduce + clip + "
                  "optimizer with the run's `step_time_s - pipeline_step_s`, and *action cost* each recorded "
                  "action's mean (the run's `mean_costs_s`) with the planned one: where an error comes from. "
                  "*Recommended per round*: the plan's recommendation each round, and how often it was declared "
                  "a tie (`plan.tie_tolerance`).", "", *_planner_summary(sizes)]
    for name, size in sizes.items():
        if len(sizes) > 1:
            lines += [f"### {name}", ""]
        if "error" in size:
            lines += [f"The planner failed: {size['error']}", ""]
            continue
        lines += _render_planner_size(size)
    return lines


def _render_planner_size(res: Mapping[str, Any]) -> list[str]:
    lines = []
    rows = _planner_rows(res)
    cals = [r["calibration"] for r in res["rounds"]]
    n = len(res["rounds"])

    def cal_range(key: str, scale: float, fmt: str) -> str:
        low, high = (f"{v * scale:{fmt}}" for v in (min(c[key] for c in cals), max(c[key] for c in cals)))
        return low if low == high else f"{low}-{high}"

    lines += ["`python -m runner.plan` on the model `" + " ".join(res["model"]) + "` at pp=2, against real runs "
              f"of every schedule (its default stages per rank) x m, {res['steps']} steps each (steady median: over "
              "the last two thirds of the steps; in results from before the model sizes, all but the first). "
              f"{n} rounds, each a fresh plan (calibration and child timings) followed by all the runs; the "
              "numbers are medians over rounds, and the measured range is min-max over rounds. Calibrated per "
              f"round: message {cal_range('latency_s', 1e6, '.0f')} us + bytes / "
              f"{cal_range('bandwidth', 1e-9, '.2f')} GB/s"
              + f", +{cal_range('busy_delay_s', 1e6, '.0f')} us while its sender computes"
              + f", runtime overhead {cal_range('action_overhead_s', 1e6, '.0f')} us per action, co-running "
              f"compute x{cal_range('corunning_slowdown', 1, '.2f')}"
              + f" (action times varying by {cal_range('action_jitter', 100, '.0f')}%)"
              + ". *Replayed* is the simulator fed each run's own recorded per-action costs (the run's "
              "`bubble.simulated_step_s`), "
              "over that run's step: the simulation's share of the error, apart from the cost estimates.", "",
              "| schedule | m | predicted (ms) | measured (ms) | measured range | predicted / measured | replayed / "
              "measured | bubble predicted | measured |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda x: (x["m"], SCHEDULES.index(x["schedule"]))):
        lines.append(f"| {r['schedule']} | {r['m']} | {r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['measured_min'] * 1e3:.2f}-{r['measured_max'] * 1e3:.2f} | "
                     f"{r['predicted_s'] / r['measured_s']:.3f} | "
                     f"{_num(r['replayed'])} | {_num(r['predicted_bubble'])} | {_num(r['measured_bubble'])} |")
    signed = [r["predicted_s"] / r["measured_s"] - 1 for r in rows]
    errors = [abs(e) for e in signed]
    if errors:
        noise = statistics.median(r["measured_max"] / r["measured_min"] - 1 for r in rows)
        lines += ["", f"Within 10% of the measured step: {sum(e <= 0.10 for e in errors)} of {len(errors)} "
                  f"(median error {statistics.median(errors):.1%}, worst {max(errors):.1%}, median signed "
                  f"{statistics.median(signed):+.1%}); a configuration's "
                  f"own runs differ by {noise:.1%} (median over configurations, slowest over fastest round)."
                  + (f" Recommended per round: {_recommendations(res)}."
                     if any("recommended" in r for r in res["rounds"]) else "")]
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m]
        rho = _ranks_agree([(r["predicted_s"], r["measured_s"]) for r in at_m])
        agree, total, wrong = _separated_pairs(at_m)
        best_p = min(at_m, key=lambda r: r["predicted_s"])
        best_m = min(at_m, key=lambda r: r["measured_s"])
        spread = max(r["measured_s"] for r in at_m) / best_m["measured_s"] - 1
        lines.append(f"- m={m}: the measured schedules differ by {spread:.0%} fastest to slowest. Of the "
                     f"{total} pairs whose measured ranges do not overlap, the prediction orders {agree} the same way"
                     + (f" (not: {', '.join(wrong)})" if wrong else "") + f"; rank correlation over all "
                     f"{len(at_m)}: {_num(rho, '.2f')}. Fastest predicted: {best_p['schedule']}, measured "
                     f"{best_p['measured_s'] / best_m['measured_s'] - 1:+.1%} against the measured fastest "
                     f"({best_m['schedule']}).")
    return lines + [""]


def _render_hf(data: Mapping[str, Any]) -> list[str]:
    res, runs = data["results"], data["results"]["runs"]
    model, total = res["model"], res["file_bytes"]
    lines = ["## Hugging Face models", "", _meta_line(data["meta"], runs), "",
             f"A Llama-shaped `model=hf` model ({model['num_hidden_layers']} layers of width "
             f"{model['hidden_size']}, {model['vocab_size']}-token vocabulary, untied head; "
             f"{total / MIB:.1f} MiB of fp32 weights) read from its directory's safetensors, "
             "`train.batch_size=32 train.seq_len=128 parallel.microbatches=8`. Steady step: the median from "
             "step 2 on, the median over repeats (runs alternate between the configurations).", "",
             "| config | steady step (s) | / unsplit | peak memory per rank (MiB) | weights read per rank (MiB) "
             "| share of the file per rank |", "|---|---|---|---|---|---|"]
    base = _median([r["steady_s"] for r in runs if r["config"] == "pp1" and r.get("steady_s")])
    for name in dict.fromkeys(r["config"] for r in runs):
        ok = [r for r in runs if r["config"] == name and r.get("status") == "ok"]
        if not ok:
            lines.append(f"| {name} | failed: {next(r for r in runs if r['config'] == name).get('error')} | | | | |")
            continue
        step = _median([r["steady_s"] for r in ok if r.get("steady_s")])
        mem = ", ".join(f"{b / MIB:.0f}" for b in ok[-1]["peak_mem_bytes"])
        read = ok[-1].get("weights_read_bytes") or []
        ratio = _num(step / base if step and base else None, ".2f")
        lines.append(f"| {name} | {_num(step, '.4f')} | {ratio} | {mem} | {', '.join(f'{b / MIB:.1f}' for b in read)} "
                     f"| {', '.join(f'{b / total:.2f}' for b in read)} |")
    return lines + ["", "Each rank reads only its own stages' tensors: at pp=2 about half the file each (the "
                        "embedding and the head are the largest tensors, on the first and the last stage). Peak "
                        "memory is the process's RSS high-water mark on CPU (interpreter, torch and transformers "
                        "included).", ""]

def _render_synthesis(data: Mapping[str, Any]) -> list[str]:
    lines = ["## Synthesized schedules against the built-ins", "", _meta_line(data["meta"]), "",
             "`python -m runner.plan plan.synthesize=true` (no memory limit) on each model, then the fastest "
             "synthesized schedule that plan found and each built-in schedule at its own best planned layout "
             "(microbatches, stages per rank, split), run in alternating rounds (every configuration once per "
             "round, the order rotated). *Ratio to synthesized*: a configuration's step over the synthesized "
             "schedule's in the same round, median and min-max over rounds (above 1: the synthesized one is "
             "faster); *predicted* is the plan's ratio. Peak activations: the plan's in-flight bytes per rank.", ""]
    for case in data["results"]["cases"]:
        lines += [f"### {case['name']}, pp={case.get('pp')}: `{' '.join(case.get('model', []))}`", ""]
        if "error" in case:
            lines += [f"Not measured: {case['error']}.", ""]
            continue
        configs = case["configs"]
        synth = configs[0]
        lines += ["| configuration | predicted (ms) | measured (ms) | predicted / measured | ratio to synthesized "
                  "(min-max) | predicted ratio | peak activations (MiB) |", "|---|---|---|---|---|---|---|"]
        wins, losses = [], []
        for c in configs:
            steps = [r.get("steady_s") or r.get("step_time_s") for r in c.get("runs", [])]
            own = [(s, t.get("steady_s") or t.get("step_time_s")) for s, t in zip(steps, synth.get("runs", []))]
            ratios = [s / t for s, t in own if s and t]
            measured = _median([s for s in steps if s])
            ratio = _median(ratios)
            spread = f" ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else ""
            lines.append(f"| {c['label']}{'*' if any(r.get('under_load') for r in c.get('runs', [])) else ''} | "
                         f"{c['predicted_s'] * 1e3:.2f} | {_num(measured and measured * 1e3, '.2f')} | "
                         f"{_num(measured and c['predicted_s'] / measured)} | {_num(ratio)}{spread} | "
                         f"{c['predicted_s'] / synth['predicted_s']:.3f} | {c['peak_activation_bytes'] / MIB:.1f} |")
            if c is not synth and ratios:
                (wins if min(ratios) > 1 else losses if max(ratios) < 1 else []).append(c["label"])
        others = len(configs) - 1
        lines += ["", f"The synthesized schedule was faster than {len(wins)} of {others} built-ins in every round"
                  + (f", slower than {', '.join(losses)} in every round" if losses else "")
                  + (f"; against the other {others - len(wins) - len(losses)} the rounds disagree (within the "
                     "run-to-run spread)" if others - len(wins) - len(losses) else "") + ".", ""]
    return lines


def render(results_dir: Path, output: Path, plot_path: Path | None = None) -> str:
    """BENCHMARKS.md from every benchmarks/<section>.json present; sections without one are listed."""
    found = {}
    for section in SECTIONS:
        path = results_dir / f"{section}.json"
        if path.is_file():
            found[section] = json.loads(path.read_text())
    plot_path = plot_path or results_dir / "bubble.png"
    out_dir = output.parent
    rel_results = os.path.relpath(results_dir, out_dir)
    lines = ["# Benchmarks", "",
             "Rendered by `scripts/bench.py` from the raw results in `" + rel_results + "/<section>.json` (machine, "
             "torch version, date, command and every run's numbers). Re-run a section with `python scripts/bench.py "
             "--only <section>` to refresh only its part; `--render` rebuilds this file from the JSON. Ratios, not "
             "absolute times, carry over between machines; each section says how long it took and whether it ran "
             "under load (another process using the 2 cores).", ""]
    machines = {json.dumps(d["meta"].get("machine"), sort_keys=True) for d in found.values()}
    if len(machines) == 1 and found:
        m = next(iter(found.values()))["meta"]["machine"]
        on = f"{m['device_name']}, NCCL" if m.get("device") == "cuda" else "CPU, gloo"
        lines += [f"Machine: {m.get('cpu')}, {m.get('arch')}, {m.get('cores')} cores, {m.get('platform')}; "
                  f"Python {m.get('python')}, torch {m.get('torch')}; {on}.", ""]
    elif found:
        lines += ["Sections ran on different machines or torch versions: see each section's line.", ""]
    renderers = {"efficiency": lambda d: _render_efficiency(d, out_dir, plot_path), "scaling": _render_scaling,
                 "options": _render_options, "overhead": _render_overhead, "startup": _render_startup,
                 "profiling": _render_profiling, "planner": _render_planner, "synthesis": _render_synthesis,
                 "device": _render_device, "hf": _render_hf}
    for section in SECTIONS:
        if section in found:
            try:
                lines += renderers[section](found[section])
            except Exception as e:  # a results file from an older layout: say so, keep the rest
                lines += [f"## {section}", "", f"Could not render `{section}.json`: {type(e).__name__}: {e}", ""]
    notes = results_dir / "notes.md"
    if notes.is_file():  # hand-written observations on the results; kept across re-renders
        lines += [notes.read_text().rstrip(), ""]
    missing = [s for s in SECTIONS if s not in found]
    todo = []
    if missing:
        todo.append("- No results yet for: " + ", ".join(missing) + " (`python scripts/bench.py --only "
                    + " ".join(missing) + "`).")
    if not any((d["meta"].get("machine") or {}).get("device") == "cuda" for d in found.values()):
        todo.append("- GPU runs: `python scripts/bench.py --device cuda` writes `BENCHMARKS-cuda.md` (on one GPU "
                    "only the `device` section runs; the others need a GPU per rank).")
    if todo:
        lines += ["## Not measured", "", *todo, ""]
    text = "\n".join(lines)
    output.write_text(text)
    return text


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, metavar="SECTION",
                        help=f"sections to run (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--render", action="store_true", help="run nothing; re-render from the JSON files")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=4, help="steps per efficiency run (bubble over steps 1..)")
    parser.add_argument("--option-steps", type=int, default=8)
    parser.add_argument("--option-repeats", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--overhead-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of profiling, startup and overhead")
    parser.add_argument("--planner-rounds", type=int, default=5, help="rounds of plan + every (schedule, m) run")
    parser.add_argument("--planner-sizes", nargs="+", choices=list(PLANNER_SIZES), default=list(PLANNER_SIZES))
    parser.add_argument("--planner-steps", type=int, default=None, help="steps per run (default: per size)")
    parser.add_argument("--planner-microbatches", type=int, nargs="+", default=None,
                        help="m values of the benchmark size (default 4 8)")
    parser.add_argument("--synthesis-rounds", type=int, default=4, help="alternating rounds of every configuration")
    parser.add_argument("--synthesis-steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help="planner and synthesis on tiny models, one round of 3 steps, results into the work "
                             "directory: checks that the sections run, measures nothing worth keeping")
    parser.add_argument("--max-wait", type=float, default=1200.0,
                        help="seconds to wait for a quiet machine before each long run (0: do not wait)")
    parser.add_argument("--rerun-loaded", action=argparse.BooleanOptionalAction, default=True,
                        help="re-run (once, after waiting) efficiency and options runs that shared the machine")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: every section whose ranks fit this host's GPUs (one GPU: only `device`)")
    parser.add_argument("--results", type=Path, default=None,
                        help="default: benchmarks/ (cpu), benchmarks/cuda/ (cuda)")
    parser.add_argument("--output", type=Path, default=None, help="default: BENCHMARKS.md (cpu), BENCHMARKS-cuda.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.planner_rounds, args.planner_steps, args.synthesis_rounds, args.synthesis_steps = 1, 3, 1, 3
        args.work = args.work or Path(tempfile.mkdtemp(prefix="runner-bench-quick-"))
        args.results = args.results or args.work / "results"
        args.output = args.output or args.work / "BENCHMARKS.md"
    cuda = args.device == "cuda"  # GPU numbers never mix with the CPU ones
    args.results = args.results or ROOT / "benchmarks" / ("cuda" if cuda else "")
    args.output = args.output or ROOT / ("BENCHMARKS-cuda.md" if cuda else "BENCHMARKS.md")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.render:
        work = args.work or Path(tempfile.mkdtemp(prefix="runner-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(args, work)
        for section in [s for s in SECTIONS if s in args.only]:
            run_section(section, ctx)
            render(args.results, args.output)  # after each section: an interrupted run keeps what it has
    print(render(args.results, args.output))


if __name__ == "__main__":
    main()
