"""A pipeline schedule as a weighted event simulation.

Each rank runs its actions in the given order; an action starts when its rank is free and its
inputs exist: ``F`` of stage s after ``F`` of stage s-1 (the activation), ``B``/``I`` of stage s
after its own ``F`` and the ``B``/``I`` of stage s+1 (the gradient), ``W`` after its ``I``. A
message between ranks adds ``comm_s``. The result is a per-rank timeline, from which the bubble
and the step time follow. Used with measured costs (the predicted timeline next to the measured
one) and with unit costs (a readable picture of the order).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from runner.pipeline.ops import Op

__all__ = ["SimAction", "simulate", "expected_makespan", "peak_in_flight", "bubble_fractions", "UNIT_COSTS",
           "repeat_steps", "steady_step", "compute_floor", "stage_spans", "rank_span", "simulated_step",
           "deferred_step", "expected_ends"]

# Relative costs for pictures: a full backward costs about two forwards; I and W split it.
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class SimAction:
    rank: int
    op: Op
    start: float
    end: float


def _cost_of(costs: Mapping[tuple[int, str], float] | Mapping[str, float], jitter: float, seed: int):
    """An action's seconds: its (stage, kind) cost or its kind's, drawn around it under ``jitter``
    (log-normal, mean the cost, that coefficient of variation; ``seed`` picks the draw)."""
    rng = random.Random(seed)
    sigma = math.sqrt(math.log1p(jitter**2))
    lookup: Mapping[Any, float] = costs  # either form: both keys are tried
    means: dict[tuple[int, str], float] = {}

    def cost(op: Op) -> float:
        key = (op.stage, op.kind)
        mean = means.get(key)
        if mean is None:
            mean = means[key] = lookup.get(key, lookup.get(op.kind, 0.0))
        return mean * rng.lognormvariate(-sigma**2 / 2, sigma) if jitter else mean

    return cost


def _ready(op: Op, rank: int, end: Mapping[tuple, float], rank_of: Mapping[int, int], comm_s: float,
           last: int) -> float | None:
    """When ``op``'s inputs exist on ``rank`` (None: not yet), the dependencies of the module
    docstring written out inline, looked up with plain tuples (an Op is one): the search replays
    tens of thousands of actions per order at p = 32."""
    s, kind, mb = op
    if kind == "F":
        if s == 0:
            return 0.0
        arrived = end.get((s - 1, "F", mb))
        return None if arrived is None else arrived + (comm_s if rank_of[s - 1] != rank else 0.0)
    if kind == "W":
        return end.get((s, "I", mb))
    ready = end.get((s, "F", mb))  # B or I: its forward, and the gradient from the next stage
    if ready is None or s == last:
        return ready
    grad = end.get((s + 1, "B", mb))
    if grad is None:
        grad = end.get((s + 1, "I", mb))
    return None if grad is None else max(ready, grad + (comm_s if rank_of[s + 1] != rank else 0.0))


def _replay(order: Mapping[int, Sequence[Op]], cost, num_stages: int, comm_s: float,
            gate: Callable[[int, int, Mapping[tuple, float]], float | None] | None = None
            ) -> tuple[dict[tuple, float], dict[Op, tuple[int, float]]]:
    """Each action's end, and its rank and start: the ranks in the given orders. ``gate(rank,
    position, end)``, where given, is the earliest the rank's action at that position may start
    beyond its inputs (None: not known yet), e.g. a step boundary's optimizer update."""
    rank_of = {op.stage: rank for rank, ops in order.items() for op in ops}
    position = {rank: 0 for rank in order}
    free_at = {rank: 0.0 for rank in order}
    end: dict[tuple, float] = {}
    placed: dict[Op, tuple[int, float]] = {}
    remaining = sum(len(ops) for ops in order.values())
    while remaining:
        progressed = False
        for rank, ops in order.items():  # each rank as far as its next action's inputs exist
            while position[rank] < len(ops):
                op = ops[position[rank]]
                ready = _ready(op, rank, end, rank_of, comm_s, num_stages - 1)
                if ready is not None and gate is not None:
                    held = gate(rank, position[rank], end)
                    ready = None if held is None else max(ready, held)
                if ready is None:
                    break
                begin = max(free_at[rank], ready)
                end[op] = free_at[rank] = begin + cost(op)
                placed[op] = (rank, begin)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: ops[position[r]].name for r, ops in order.items() if position[r] < len(ops)}
            raise ValueError(f"the schedule cannot progress: ranks wait at {stuck}")
    return end, placed


def simulate(
    order: Mapping[int, Sequence[Op]],
    costs: Mapping[tuple[int, str], float] | Mapping[str, float],
    *,
    num_stages: int,
    comm_s: float = 0.0,
    jitter: float = 0.0,
    seed: int = 0,
) -> list[SimAction]:
    """Replay per-rank action orders. ``costs`` maps (stage, kind) or kind to seconds. With
    ``jitter`` > 0 each action's time is drawn around its cost (``_cost_of``)."""
    end, placed = _replay(order, _cost_of(costs, jitter, seed), num_stages, comm_s)
    done = [SimAction(rank, op, begin, end[op]) for op, (rank, begin) in placed.items()]
    return sorted(done, key=lambda a: (a.rank, a.start))


def simulated_step(order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float], *, num_stages: int,
                   comm_s: float = 0.0, barrier: bool = True,
                   meetings: Sequence[tuple[Sequence[int], float]] = ()) -> float:
    """What the search scores, without building the timeline (at p = 32 that is half a replay's
    time): with the barrier the makespan, up to where every rank has ended its backward and the
    tied weights' gradient sums it takes part in (``meetings``, as ``expected_makespan`` has them:
    what the planner predicts the order with); without it the longest rank's span (``rank_span``; a
    rank runs its actions in order, so its span is its first action's start to its last's end)."""
    end, placed = _replay(order, _cost_of(costs, 0.0, 0), num_stages, comm_s)
    if barrier:
        return max(_meet({rank: end[ops[-1]] for rank, ops in order.items() if ops}, meetings).values())
    return max(end[ops[-1]] - placed[ops[0]][1] for ops in order.values() if ops)


def expected_makespan(
    order: Mapping[int, Sequence[Op]],
    costs: Mapping[tuple[int, str], float] | Mapping[str, float],
    *,
    num_stages: int,
    comm_s: float = 0.0,
    jitter: float = 0.0,
    samples: int = 32,
    meetings: Sequence[tuple[Sequence[int], float]] = (),
) -> float:
    """The mean step length when action times vary by ``jitter`` around their costs: longer than
    the step of mean times, since every dependency waits for the later of its inputs. With
    ``meetings`` (the tied weights' gradient sums, as ``deferred_step`` takes them) the step with
    the barrier up to where every rank has ended its backward and its sums (``_meet``): a sum
    starts when the last of its ranks has ended its own last action."""
    return expected_ends(order, costs, num_stages=num_stages, comm_s=comm_s, jitter=jitter, samples=samples,
                         meetings=meetings)[1]


def expected_ends(order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float] | Mapping[str, float],
                  *, num_stages: int, comm_s: float = 0.0, jitter: float = 0.0, samples: int = 32,
                  meetings: Sequence[tuple[Sequence[int], float]] = ()) -> tuple[float, float]:
    """``expected_makespan`` without and with ``meetings``, from the same draws: the pipeline's mean
    end, and the mean end of the tied weights' gradient sums after it (the same without any)."""
    if not jitter:
        samples = 1
    pipeline, met = [], []
    for seed in range(samples):
        end, _ = _replay(order, _cost_of(costs, jitter, seed), num_stages, comm_s)
        last = {rank: end[ops[-1]] for rank, ops in order.items() if ops}
        pipeline.append(max(last.values()))
        met.append(max(_meet(last, meetings).values()))
    return statistics.fmean(pipeline), statistics.fmean(met)


def _meet(times: Mapping[int, float], meetings: Sequence[tuple[Sequence[int], float]]) -> dict[int, float]:
    """Each rank's time after the tied weights' gradient sums it takes part in (``meetings``: the
    pipeline ranks holding a copy and the seconds of their all-reduce, in the order
    ``TiedWeights.sync_grads`` runs them), from ``times``, when each rank arrives: a sum starts
    when the last of its ranks arrives. One rank holding every copy (V placements) meets nobody."""
    out = dict(times)
    for ranks, seconds in meetings:
        if len(set(ranks)) > 1:
            met = max(out[r] for r in ranks) + seconds
            out.update({r: met for r in ranks})
    return out


def peak_in_flight(order: Mapping[int, Sequence[Op]], weights: Mapping[int, float] | None = None,
                   weight_grad_fraction: float = 1.0) -> dict[int, float]:
    """Per rank, the most forward activations held at once, walking the rank's order, per action
    (Qi et al. 2024, Table 1): a forward holds its stage-microbatch (M_B); a full backward (B)
    frees it; a split backward's input-gradient pass (I) frees all but what the weight gradient
    needs (``weight_grad_fraction`` = M_W / M_B), and its W frees the rest. Counted in
    stage-microbatches, or in bytes with ``weights`` (stage -> M_B of one stage-microbatch); a
    fraction of 1 counts a microbatch as held until its W (whole numbers of microbatches)."""
    peaks: dict[int, float] = {}
    keep = weight_grad_fraction
    for rank, ops in order.items():
        live: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> what it still holds
        held = peak = 0.0
        for op in ops:
            key, w = (op.stage, op.microbatch), (weights[op.stage] if weights is not None else 1.0)
            if op.kind == "F" and key not in live:
                live[key] = w
                held += w
                peak = max(peak, held)
            elif op.kind == "I" and key in live:
                held -= live[key] - keep * w
                live[key] = keep * w
            elif op.kind in "BW" and key in live:
                held -= live.pop(key)
        peaks[rank] = int(peak) if weights is None and keep == 1.0 else peak
    return peaks


def bubble_fractions(actions: Sequence[SimAction]) -> dict[int, float]:
    """Per rank: the fraction of the step (first start to last end, over all ranks) not computing."""
    makespan = max(a.end for a in actions) - min(a.start for a in actions)
    busy: dict[int, float] = {}
    for a in actions:
        busy[a.rank] = busy.get(a.rank, 0.0) + a.end - a.start
    return {rank: 1.0 - b / makespan for rank, b in sorted(busy.items())}


def stage_spans(actions: Sequence[SimAction]) -> dict[int, float]:
    """Per rank: its own first start to its own last end. The Zero Bubble paper's cost of a step is
    the largest of these (its Table 5; the authors' ``efficiency.py``), not the makespan over all
    ranks: a rank that starts late and ends late counts only its own span."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for a in actions:
        first[a.rank] = min(first.get(a.rank, a.start), a.start)
        last[a.rank] = max(last.get(a.rank, a.end), a.end)
    return {rank: last[rank] - first[rank] for rank in sorted(first)}


def repeat_steps(order: Mapping[int, Sequence[Op]], steps: int) -> dict[int, list[Op]]:
    """``steps`` copies of a step's ``order`` back to back on each rank, microbatches renumbered
    (step k's microbatch i is ``k * m + i``): consecutive steps with no barrier between them, each
    rank starting step k+1 once its own step k is done (the optimizer's time not counted)."""
    m = 1 + max(op.microbatch for ops in order.values() for op in ops)
    return {rank: [Op(op.stage, op.kind, k * m + op.microbatch) for k in range(steps) for op in ops]
            for rank, ops in order.items()}


def steady_step(order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float] | Mapping[str, float],
                *, num_stages: int, steps: int = 4, comm_s: float = 0.0) -> tuple[float, dict[int, float]]:
    """Without the barrier (the Zero Bubble paper's post-validation): the steady-state step of
    ``steps`` consecutive steps (``repeat_steps``), the time between the ends of the last two, and
    each rank's bubble within it (1 - its compute per step / that time). One step's cool-down may
    then run under the next one's warm-up; no order beats ``compute_floor``."""
    if steps < 2:
        raise ValueError(f"steps={steps}: a steady state needs at least 2 steps")
    m = 1 + max(op.microbatch for ops in order.values() for op in ops)
    actions = simulate(repeat_steps(order, steps), costs, num_stages=num_stages, comm_s=comm_s)
    ends = [max(a.end for a in actions if a.op.microbatch // m == k) for k in (steps - 2, steps - 1)]
    step = ends[1] - ends[0]
    work = _work(order, costs)
    return step, {rank: 1.0 - w / step for rank, w in sorted(work.items())}


def _deferred_gate(order: Mapping[int, Sequence[Op]], m: int, update_s: Mapping[int, float], reduce_s: float,
                   meetings: Sequence[tuple[Sequence[int], float]]):
    """``train.optimizer_sync=deferred``'s step boundary (``runner.train.Trainer.step``): rank r's
    step k+1 begins after its own step k's forward and backward end (``e(r, k)``: its last action,
    then the tied weights' gradient sums it takes part in: ``_meet``), then the wait for step k-1's
    loss and norm all-reduce (``R(k-1)``, done ``reduce_s`` after the last rank started it), then
    step k's update (``update_s[r]``: the norm's squares that start step k's all-reduce, the
    snapshot, AdamW). So ``s(r, k) = max(e(r, k), R(k-1))``, ``R(k) = max_r s(r, k) + reduce_s`` and step k+1
    starts at ``s(r, k) + update_s[r]``."""
    size = {rank: len(ops) for rank, ops in order.items()}
    last = {rank: (ops[-1].stage, ops[-1].kind, ops[-1].microbatch) for rank, ops in order.items() if ops}
    left: dict[int, dict[int, float]] = {}  # step -> e(r, k) of every rank
    started: dict[tuple[int, int], float] = {}  # (rank, step) -> s(r, k)
    reduced: dict[int, float] = {-1: -math.inf}  # step -> R(k)

    def leave(k: int, end: Mapping[tuple, float]) -> dict[int, float] | None:
        if k not in left:
            own = {rank: end.get((s, kind, k * m + mb)) for rank, (s, kind, mb) in last.items()}
            if any(t is None for t in own.values()):
                return None
            left[k] = _meet({rank: t for rank, t in own.items() if t is not None}, meetings)  # the tied sums
        return left[k]

    def start(rank: int, k: int, end: Mapping[tuple, float]) -> float | None:
        if (rank, k) not in started:
            own, before = leave(k, end), reduce_done(k - 1, end)
            if own is None or before is None:
                return None
            started[rank, k] = max(own[rank], before)
        return started[rank, k]

    def reduce_done(k: int, end: Mapping[tuple, float]) -> float | None:
        if k not in reduced:
            starts = [start(rank, k, end) for rank in last]
            if any(t is None for t in starts):
                return None
            reduced[k] = max(t for t in starts if t is not None) + reduce_s
        return reduced[k]

    def gate(rank: int, position: int, end: Mapping[tuple, float]) -> float | None:
        k, at = divmod(position, size[rank])
        if at or not k:
            return 0.0
        began = start(rank, k - 1, end)
        return None if began is None else began + update_s.get(rank, 0.0)

    return gate


def deferred_step(order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float] | Mapping[str, float],
                  *, num_stages: int, comm_s: float = 0.0, update_s: Mapping[int, float] | None = None,
                  reduce_s: float = 0.0, meetings: Sequence[tuple[Sequence[int], float]] = (), jitter: float = 0.0,
                  samples: int = 16, steps: int = 8) -> float:
    """The steady step of ``train.optimizer_sync=deferred`` (no barrier between steps): ``steps``
    copies of ``order`` replayed back to back (``repeat_steps``) with each rank's update, the tied
    weights' gradient sums (``meetings``: the ranks holding a copy meet after every backward) and the
    deferred validation's wait between its steps (``_deferred_gate``; messages at the step boundary
    cost ``comm_s`` as any), measured as ``bubble.steady`` measures a run: the time between the
    pipeline's ends (the last action of a step on any rank) of step ``steps // 2`` and the last,
    per step (the first steps settle). With ``jitter``, the mean over ``samples`` draws: every
    step then waits for its slowest rank's draw, as a run does."""
    m = 1 + max(op.microbatch for ops in order.values() for op in ops)
    first = steps // 2
    periods = []
    for seed in range(samples if jitter else 1):
        end, _ = _deferred_replay(order, _cost_of(costs, jitter, seed), num_stages=num_stages, comm_s=comm_s,
                                  update_s=update_s, reduce_s=reduce_s, meetings=meetings, steps=steps)
        ends = {k: max(t for op, t in end.items() if op[2] // m == k) for k in (first - 1, steps - 1)}
        periods.append((ends[steps - 1] - ends[first - 1]) / (steps - first))
    return statistics.fmean(periods)


def _deferred_replay(order: Mapping[int, Sequence[Op]], cost, *, num_stages: int, comm_s: float,
                     update_s: Mapping[int, float] | None, reduce_s: float,
                     meetings: Sequence[tuple[Sequence[int], float]], steps: int
                     ) -> tuple[dict[tuple, float], dict[Op, tuple[int, float]]]:
    m = 1 + max(op.microbatch for ops in order.values() for op in ops)
    return _replay(repeat_steps(order, steps), cost, num_stages, comm_s,
                   _deferred_gate(order, m, update_s or {}, reduce_s, meetings))


def _deferred_timeline(order: Mapping[int, Sequence[Op]],
                      costs: Mapping[tuple[int, str], float] | Mapping[str, float], *, num_stages: int,
                      comm_s: float = 0.0, update_s: Mapping[int, float] | None = None, reduce_s: float = 0.0,
                      meetings: Sequence[tuple[Sequence[int], float]] = (), steps: int = 8) -> list[SimAction]:
    """``deferred_step``'s replay with mean times as a timeline: ``steps`` steps back to back, step
    k's microbatch i numbered ``k * m + i`` (``repeat_steps``), sorted by rank and start. Private:
    the tests read each rank's steps from it; nothing of the runner draws it."""
    end, placed = _deferred_replay(order, _cost_of(costs, 0.0, 0), num_stages=num_stages, comm_s=comm_s,
                                   update_s=update_s, reduce_s=reduce_s, meetings=meetings, steps=steps)
    return sorted((SimAction(rank, op, begin, end[op]) for op, (rank, begin) in placed.items()),
                  key=lambda a: (a.rank, a.start))


def rank_span(actions: Sequence[SimAction]) -> float:
    """The Zero Bubble paper's step without the barrier: the longest of the ranks' spans, each from
    the rank's first start to its last end within one step. Repeated back to back, the step can
    be shifted by this much and still run (each rank starts its next step when its own ends), so
    ``steady_step`` is never longer."""
    return max(stage_spans(actions).values())


def compute_floor(order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float] | Mapping[str, float]
                  ) -> float:
    """The least a step can take once steps overlap: the busiest rank's compute per step (the
    paper's m(F+B+W) for equal stages). With the barrier a step also waits for the F ramp."""
    return max(_work(order, costs).values())


def _work(order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float] | Mapping[str, float]
          ) -> dict[int, float]:
    cost = _cost_of(costs, 0.0, 0)
    return {rank: sum(cost(op) for op in ops) for rank, ops in order.items()}
