"""Schedule synthesis: a per-rank action order for measured stage costs, a stage placement and a
memory budget, found by a search that the simulator scores.

The search starts from the built-in schedules' orders for the placement, without the barrier from
round schedules (``runner.plan.rounds``: the paper's ZB-2p in spirit), and from list schedules
built with the zero-bubble heuristics (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"):
forwards while memory allows, a backward as soon as its gradient arrives, the weight gradients
(W) of a split backward into the slots where the rank would otherwise wait. It then improves the
best order by local moves: a W moved, two neighbouring actions swapped, an I and its W merged
into one B (cheaper: one autograd pass) or a B split into both (its W can then wait). Every
order is scored by the jitter-free simulation (``runner.pipeline.simulate``): its makespan, or
without the barrier (``Problem.barrier``) the longest rank's span; the search is bounded by
the number of orders it evaluates, so its result depends on the costs and the seed only, never
on how busy the machine is.

Orders keep each stage's forwards, its backwards (B or I) and its Ws in microbatch order, as
every built-in schedule does (the runtime's sends and receives pair up in that order).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from runner.pipeline.ops import Op
from runner.pipeline.simulate import peak_in_flight, simulated_step
from runner.plan.list_schedule import Policy, list_schedule, policies
from runner.plan.problem import Order, Problem, lower_bound
from runner.plan.rounds import round_schedule, round_variants

__all__ = ["Problem", "Policy", "Synthesis", "lower_bound", "list_schedule", "synthesize"]


def _position(ops: Sequence[Op], op: Op) -> int:
    return next(i for i, o in enumerate(ops) if o == op)


def _kind_class(kind: str) -> str:
    return "B" if kind in "BI" else kind


def _neighbour(order: Order, rng: random.Random, moves: Sequence[str]) -> Order | None:
    """One local move on a copy of ``order`` (None where the drawn move does not apply): a W moved
    within its room, two neighbours swapped, an I and its W merged into a B, or a B split."""
    rank = rng.choice([r for r, ops in order.items() if len(ops) > 1])
    ops = list(order[rank])
    move = rng.choice(moves)
    if move == "swap":
        i = rng.randrange(len(ops) - 1)
        a, b = ops[i], ops[i + 1]
        if a.stage == b.stage and (a.microbatch == b.microbatch or _kind_class(a.kind) == _kind_class(b.kind)):
            return None  # a dependency, or the stage's microbatch order
        ops[i], ops[i + 1] = b, a
    elif move == "move_w":
        ws = [i for i, o in enumerate(ops) if o.kind == "W"]
        if not ws:
            return None
        i = rng.choice(ws)
        w = ops.pop(i)
        lo = _position(ops, Op(w.stage, "I", w.microbatch)) + 1
        lo = max([lo] + [j + 1 for j, o in enumerate(ops) if o.stage == w.stage and o.kind == "W"
                         and o.microbatch < w.microbatch])
        hi = min([len(ops)] + [j for j, o in enumerate(ops) if o.stage == w.stage and o.kind == "W"
                               and o.microbatch > w.microbatch])
        if hi <= lo:
            return None
        j = rng.randint(lo, hi)
        if j == i:
            return None
        ops.insert(j, w)
    elif move == "merge":
        inputs = [i for i, o in enumerate(ops) if o.kind == "I"]
        if not inputs:
            return None
        i = rng.choice(inputs)
        op = ops[i]
        ops[i] = Op(op.stage, "B", op.microbatch)
        ops.remove(Op(op.stage, "W", op.microbatch))
    else:  # split
        fulls = [i for i, o in enumerate(ops) if o.kind == "B" and o.stage > 0]
        if not fulls:
            return None
        i = rng.choice(fulls)
        op = ops[i]
        ops[i] = Op(op.stage, "I", op.microbatch)
        after = max([i] + [j for j, o in enumerate(ops) if o.stage == op.stage and o.kind == "W"
                           and o.microbatch < op.microbatch])
        ops.insert(after + 1, Op(op.stage, "W", op.microbatch))
    return {**order, rank: ops}


@dataclass
class Synthesis:
    order: Order
    makespan_s: float  # jitter-free simulated pipeline (without the barrier: the longest rank's span)
    lower_bound_s: float
    origin: str  # the seed or heuristic the best order grew from
    evaluated: int  # orders simulated
    rejected: int  # of those: could not run, over the budget, or refused by ``check``
    improved_by_moves: int  # accepted local moves that made the best better
    seconds: float


def _score(p: Problem, order: Order) -> tuple[float, float] | None:
    """(step, peak held per rank): None when the order cannot run or exceeds the budget. The step is
    the makespan with the barrier, the longest rank's span without it (``Problem.barrier``)."""
    weights = dict(p.stage_bytes) if p.stage_bytes is not None else None
    peak = max(peak_in_flight(order, weights, p.weight_grad_fraction).values())
    if p.memory_limit is not None and peak > p.memory_limit * (1 + 1e-9):  # sums of fractions round
        return None  # (checked first: a replay costs several times more)
    try:
        step = simulated_step(order, p.costs, num_stages=p.num_stages, comm_s=p.comm_s, barrier=p.barrier)
    except ValueError:
        return None
    return step, peak


def synthesize(p: Problem, *, seeds: Mapping[str, Order], budget: int = 200, seed: int | str = 0,
               check: Callable[[Order], None] | None = None) -> Synthesis | None:
    """The fastest order found among ``budget`` evaluated ones (seeds, without the barrier round
    schedules, then list schedules up to about half the budget, then local moves from the best).
    ``check`` raises on an order the runtime would refuse (the planner passes torch's dry run of
    the CSV); a new best must pass it. None when no order fits the budget."""
    started = time.perf_counter()
    rng = random.Random(seed)
    stats = {"evaluated": 0, "rejected": 0, "moves": 0}
    best: list = []  # [score, order, origin]

    def consider(order: Order | None, origin: str) -> tuple[float, float] | None:
        stats["evaluated"] += 1
        if order is None or (score := _score(p, order)) is None:
            stats["rejected"] += 1
            return None
        if not best or score < best[0]:
            if check is not None:
                try:
                    check(order)
                except Exception:  # noqa: BLE001  (the runtime refuses it: not a candidate)
                    stats["rejected"] += 1
                    return None
            best[:] = [score, order, origin]
        return score

    for name, order in seeds.items():
        consider(order, name)
    # Where steps overlap, round schedules too (the paper's ZB-2p in spirit); with the barrier none.
    variants = round_variants(p) if not p.barrier else []
    for variant in variants:
        consider(round_schedule(p, variant), variant.describe())
    for policy in policies(p, rng, budget // 2 - len(seeds) - len(variants)):
        consider(list_schedule(p, policy, rng), policy.describe())
    if not best:
        return None
    current, current_score, stale = best[1], best[0], 0
    moves = ["move_w", "move_w", "swap", "swap"] + ["merge"] * p.whole + ["split"] * p.splits
    attempts = 0
    while stats["evaluated"] < budget and attempts < 50 * budget:
        attempts += 1
        candidate = _neighbour(current, rng, moves)
        if candidate is None:
            continue
        before = best[0]
        score = consider(candidate, best[2])
        if score is not None and score <= current_score:  # sideways moves too: W moves pay off in pairs
            current, current_score = candidate, score
        if best[0] < before:
            stats["moves"] += 1
            best[2] = best[2] if best[2].endswith("+ moves") else f"{best[2]} + moves"
            stale = 0
        else:
            stale += 1
        if stale > budget // 8:  # wandered off: back to the best
            current, current_score, stale = best[1], best[0], 0
    return Synthesis(order=best[1], makespan_s=best[0][0], lower_bound_s=lower_bound(p), origin=best[2],
                     evaluated=stats["evaluated"], rejected=stats["rejected"], improved_by_moves=stats["moves"],
                     seconds=time.perf_counter() - started)
