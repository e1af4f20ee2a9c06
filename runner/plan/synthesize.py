"""Schedule synthesis: a per-rank action order for measured stage costs, a stage placement and a
memory budget, found by a search that the simulator scores.

The search starts from the built-in schedules' orders for the placement, without the barrier from
round schedules (``runner.plan.rounds``: the paper's ZB-2p in spirit), and from list schedules
built with the zero-bubble heuristics (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"):
forwards while memory allows, a backward as soon as its gradient arrives, the weight gradients
(W) of a split backward into the slots where the rank would otherwise wait. It then improves the
best order by local moves: a W moved, two neighbouring actions swapped, an I and its W merged
into one B (cheaper: one autograd pass) or a B split into both (its W can then wait). Every
order is scored by the jitter-free simulation (``runner.pipeline.simulate``): its makespan (up to
the end of the tied weights' gradient sums, ``Problem.meetings``, as the plan predicts it), or
without the barrier (``Problem.barrier``) the longest rank's span, a cheap stand-in for the steady
step of overlapping steps; there the ``FINALISTS`` orders of the shortest spans are then scored by
that steady step itself (``deferred_step``, the measure every plan without the barrier reports) and
the best of those is the result. The search is bounded by the number of orders it evaluates, so its
result depends on the costs and the seed only, never on how busy the machine is.

Orders keep each stage's forwards, its backwards (B or I) and its Ws in microbatch order, as
every built-in schedule does (the runtime's sends and receives pair up in that order).
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass
from typing import AbstractSet, Callable, Mapping, Sequence

from runner.pipeline.ops import Op
from runner.pipeline.simulate import deferred_step, peak_in_flight, simulated_step
from runner.plan.list_schedule import Policy, list_schedule, policies
from runner.plan.problem import Order, Problem, lower_bound
from runner.plan.rounds import round_schedule, round_variants

__all__ = ["Problem", "Policy", "Synthesis", "FINALISTS", "lower_bound", "list_schedule", "rescore", "synthesize"]

# Without the barrier: how many orders of the shortest spans, and of the last bests, are scored by the
# steady step at the end (each a replay of 8 steps: at most 8 of them cost what 64 of the search's orders do).
FINALISTS = 4


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
    # jitter-free simulated pipeline; without the barrier the steady step of overlapping steps
    # (``deferred_step`` without updates), as every plan without the barrier scores its candidates
    makespan_s: float
    lower_bound_s: float
    origin: str  # the seed or heuristic the best order grew from
    evaluated: int  # orders simulated
    rejected: int  # of those: could not run, over the budget, or refused by ``check``
    improved_by_moves: int  # accepted local moves that made the best better
    seconds: float
    span_s: float | None = None  # without the barrier: the longest rank's span, what the search itself minimised


def _score(p: Problem, order: Order) -> tuple[float, float] | None:
    """(step, peak held per rank): None when the order cannot run or exceeds the budget. The step is
    the makespan with the barrier, the longest rank's span without it (``Problem.barrier``)."""
    weights = dict(p.stage_bytes) if p.stage_bytes is not None else None
    peak = max(peak_in_flight(order, weights, p.weight_grad_fraction).values())
    if p.memory_limit is not None and peak > p.memory_limit * (1 + 1e-9):  # sums of fractions round
        return None  # (checked first: a replay costs several times more)
    try:
        step = simulated_step(order, p.costs, num_stages=p.num_stages, comm_s=p.comm_s, barrier=p.barrier,
                              meetings=p.meetings)
    except ValueError:
        return None
    return step, peak


def _key(order: Order) -> tuple:
    return tuple((rank, tuple(ops)) for rank, ops in sorted(order.items()))


class _Finalists:
    """The ``FINALISTS`` distinct orders of the shortest spans seen (without the barrier), and the
    last ``FINALISTS`` that were the search's best when found (``check`` accepted those already:
    where the runtime refuses shorter spans, they still leave an accepted order to re-score)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, tuple, Order, str]] = []  # (-span, n, key, order, origin): the longest first
        self.keys: set[tuple] = set()
        self.bests: list[tuple[float, Order, str]] = []

    def best(self, span: float, order: Order, origin: str) -> None:
        self.bests = [*self.bests[1 - FINALISTS:], (span, order, origin)]

    def offer(self, span: float, order: Order, origin: str) -> None:
        key = _key(order)
        if key in self.keys or (len(self.heap) >= FINALISTS and span >= -self.heap[0][0]):
            return
        heapq.heappush(self.heap, (-span, len(self.keys), key, order, origin))
        self.keys.add(key)
        if len(self.heap) > FINALISTS:
            self.keys.discard(heapq.heappop(self.heap)[2])

    def entries(self) -> list[tuple[float, Order, str]]:
        shortest = [(-span, order, origin) for span, _, _, order, origin in sorted(self.heap, reverse=True)]
        return shortest + [b for b in self.bests if _key(b[1]) not in self.keys]

    def accepted(self) -> set[tuple]:
        return {_key(order) for _, order, _ in self.bests}


def rescore(p: Problem, finalists: Sequence[tuple[float, Order, str]], check: Callable[[Order], None] | None = None,
            accepted: AbstractSet[tuple] = frozenset()) -> tuple[float, float, Order, str] | None:
    """Of ``finalists`` ((span, order, origin)), the one whose steady step without the barrier
    (``deferred_step`` without updates, with the tied sums' meetings: what plans without the barrier
    report) is shortest, the span
    breaking ties, that ``check`` accepts (``accepted``: the keys of orders it accepted already):
    (steady step, span, order, origin); None where it accepts none."""
    scored = sorted((deferred_step(order, p.costs, num_stages=p.num_stages, comm_s=p.comm_s, meetings=p.meetings),
                     span, n) for n, (span, order, _) in enumerate(finalists))
    for steady, span, n in scored:
        order, origin = finalists[n][1], finalists[n][2]
        try:
            if check is not None and _key(order) not in accepted:
                check(order)
        except Exception:  # noqa: BLE001  (the runtime refuses it: not a candidate)
            continue
        return steady, span, order, origin
    return None


def synthesize(p: Problem, *, seeds: Mapping[str, Order], budget: int = 200, seed: int | str = 0,
               check: Callable[[Order], None] | None = None) -> Synthesis | None:
    """The fastest order found among ``budget`` evaluated ones (seeds, without the barrier round
    schedules, then list schedules up to about half the budget, then local moves from the best;
    without the barrier its finalists re-scored: ``rescore``). ``check`` raises on an order the
    runtime would refuse (torch's dry run of the CSV); a new best must pass it. None: none fits."""
    started = time.perf_counter()
    rng = random.Random(seed)
    stats = {"evaluated": 0, "rejected": 0, "moves": 0}
    best: list = []  # [score, order, origin]
    finalists = _Finalists()

    def consider(order: Order | None, origin: str) -> tuple[float, float] | None:
        stats["evaluated"] += 1
        if order is None or (score := _score(p, order)) is None:
            stats["rejected"] += 1
            return None
        if not p.barrier:
            finalists.offer(score[0], order, origin)
        if not best or score < best[0]:
            if check is not None:
                try:
                    check(order)
                except Exception:  # noqa: BLE001  (the runtime refuses it: not a candidate)
                    stats["rejected"] += 1
                    return None
            best[:] = [score, order, origin]
            finalists.best(score[0], order, origin)
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
    moves, attempts = ["move_w", "move_w", "swap", "swap"] + ["merge"] * p.whole + ["split"] * p.splits, 0
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
    return _result(p, best, finalists, check, stats, started)


def _result(p: Problem, best: list, finalists: _Finalists, check: Callable[[Order], None] | None,
            stats: Mapping[str, int], started: float) -> Synthesis:
    """The search's ``best`` ([score, order, origin]); without the barrier its finalists re-scored."""
    step, span, order, origin = best[0][0], None, best[1], best[2]
    if not p.barrier:  # the best span is a finalist, and passed ``check``: one is always found
        step, span, order, origin = (rescore(p, finalists.entries(), check, finalists.accepted())
                                     or (step, step, order, origin))
        origin = best[2] if _key(order) == _key(best[1]) else origin  # "+ moves" where they made it
    return Synthesis(order=order, makespan_s=step, lower_bound_s=lower_bound(p), origin=origin,
                     evaluated=stats["evaluated"], rejected=stats["rejected"], improved_by_moves=stats["moves"],
                     seconds=time.perf_counter() - started, span_s=span)
