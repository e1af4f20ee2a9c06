"""Schedule synthesis: a per-rank action order for measured stage costs, a stage placement and a
memory budget, found by a search that the simulator scores.

The search starts from the built-in schedules' orders for the placement and from list schedules
built with the zero-bubble heuristics (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"):
forwards while memory allows, a backward as soon as its gradient arrives, the weight gradients
(W) of a split backward into the slots where the rank would otherwise wait. It then improves the
best order by local moves: a W moved, two neighbouring actions swapped, an I and its W merged
into one B (cheaper: one autograd pass) or a B split into both (its W can then wait). Every
order is scored by the jitter-free simulation (``runner.plan.simulate``); the search is bounded by
the number of orders it evaluates, so its result depends on the costs and the seed only, never
on how busy the machine is.

Orders keep each stage's forwards, its backwards (B or I) and its Ws in microbatch order, as
every built-in schedule does (the runtime's sends and receives pair up in that order).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from runner.ops import Op
from runner.plan.simulate import peak_in_flight, simulate

__all__ = ["Problem", "Policy", "Synthesis", "lower_bound", "list_schedule", "synthesize"]

Order = dict[int, list[Op]]


@dataclass(frozen=True)
class Problem:
    """What the order is searched for: costs of (stage, F/B/I/W) in seconds, the stage placement,
    the cost of a message between ranks, and the activation budget per rank."""

    microbatches: int
    stage_to_rank: Mapping[int, int]
    costs: Mapping[tuple[int, str], float]
    comm_s: float = 0.0
    # Bytes one stage-microbatch's forward keeps until its backward (B, or W after an I) frees
    # it; None counts stage-microbatches instead. ``memory_limit`` is in the same unit.
    stage_bytes: Mapping[int, float] | None = None
    memory_limit: float | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def pp(self) -> int:
        return 1 + max(self.stage_to_rank.values())

    def stages_on(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_to_rank.items() if r == rank)

    def weight(self, stage: int) -> float:
        return self.stage_bytes[stage] if self.stage_bytes is not None else 1.0

    def hop(self, a: int, b: int) -> float:
        return self.comm_s if self.stage_to_rank[a] != self.stage_to_rank[b] else 0.0

    @property
    def splits(self) -> bool:
        """Whether I and W have costs (a previous run of whole-B schedules measured none)."""
        return all((s, k) in self.costs for s in range(1, self.num_stages) for k in "IW")

    @property
    def whole(self) -> bool:
        """Whether B has costs (a previous run of a zero-bubble schedule may have only I and W)."""
        return all((s, "B") in self.costs for s in range(self.num_stages))


def lower_bound(p: Problem) -> float:
    """No order of these actions on this placement finishes sooner: the larger of one
    microbatch's path through every forward and back, and, per rank, its compute (each backward
    at the cheaper of B and I + W) after the first forward can reach it, plus what must follow
    its last action (the rest of that gradient's path, or the extra a split backward costs when
    the rank ends on a W)."""
    n, m = p.num_stages, p.microbatches

    def c(s: int, kind: str) -> float:  # an action without a cost cannot be used
        return p.costs.get((s, kind), math.inf)

    back = {s: min(c(s, "B"), c(s, "I") + c(s, "W")) for s in range(n)}
    passes_on = {s: min(c(s, "B"), c(s, "I")) for s in range(1, n)}  # what sends the gradient on
    arrive = [0.0]  # the first microbatch's forward reaches stage s
    for s in range(1, n):
        arrive.append(arrive[-1] + c(s - 1, "F") + p.hop(s - 1, s))
    after = {0: 0.0}  # from the end of stage s's B/I to the end of that microbatch's stage-0 backward
    for s in range(1, n):
        after[s] = p.hop(s, s - 1) + (back[0] if s == 1 else passes_on[s - 1]) + after[s - 1]
    if n == 1:
        path = c(0, "F") + back[0]
    else:
        path = arrive[-1] + c(n - 1, "F") + passes_on[n - 1] + after[n - 1]
    bound = path
    for r in range(p.pp):
        stages = p.stages_on(r)
        work = sum(m * (c(s, "F") + back[s]) for s in stages)
        tail = min(0.0 if s == 0 else min(after[s], c(s, "I") + c(s, "W") - back[s]) for s in stages)
        bound = max(bound, min(arrive[s] for s in stages) + work + tail)
    return bound


@dataclass(frozen=True)
class Policy:
    """How a list schedule picks a rank's next action among the ready ones."""

    split: bool  # I then W instead of B (stage 0 keeps B: its I would compute nothing)
    backward_first: bool  # a ready B/I before a ready F (1F1B-like); else forwards first (GPipe-like)
    deep_first: bool  # among ready actions of one kind and microbatch, the later stage first
    in_flight: tuple[int, ...] | None = None  # per rank, at most this many stage-microbatches held
    slack: float = 0.0  # seconds a rank may wait for a more urgent action rather than start another
    noise: float = 0.0  # random jitter of microbatch priorities, for variety

    def describe(self) -> str:
        caps = "memory" if self.in_flight is None else "/".join(map(str, self.in_flight))
        return (f"list({'I+W' if self.split else 'B'}, {'backward' if self.backward_first else 'forward'} first, "
                f"{'deep' if self.deep_first else 'shallow'} first, in flight {caps}, slack {self.slack * 1e3:.2f} ms"
                f"{f', noise {self.noise:.1f}' if self.noise else ''})")


def list_schedule(p: Problem, policy: Policy, rng: random.Random) -> Order | None:
    """Build an order by simulating the ranks and letting each free rank pick, among the actions
    it could start soonest (within ``policy.slack``), the most urgent by the policy: backward
    (B/I), forward and fill (W, and stage 0's deferred B when split) classes, then microbatch,
    then stage. A microbatch enters a rank (its forward on the rank's first stage) only while
    the budget holds it through all of the rank's stages on top of what the microbatches already
    inside may still take, so that those can always go on: no order it builds deadlocks on
    memory. None when the budget cannot hold one microbatch."""
    n, m = p.num_stages, p.microbatches
    local = {r: p.stages_on(r) for r in range(p.pp)}
    end: dict[Op, float] = {}
    order: Order = {r: [] for r in range(p.pp)}
    free = {r: 0.0 for r in range(p.pp)}
    held = {r: 0.0 for r in range(p.pp)}  # bytes (or stage-microbatches) of forwards not yet freed
    count = {r: 0 for r in range(p.pp)}  # stage-microbatches, for policy.in_flight
    # What the microbatches inside a rank will still take (their forwards on its later stages).
    reserved = {r: 0.0 for r in range(p.pp)}
    reserved_count = {r: 0 for r in range(p.pp)}
    footprint = {r: sum(p.weight(s) for s in local[r]) for r in range(p.pp)}
    next_f, next_b = [0] * n, [0] * n
    waiting_w: list[deque[int]] = [deque() for _ in range(n)]
    jitter = {(s, i): rng.random() * policy.noise for s in range(n) for i in range(m)} if policy.noise else {}
    classes = {"back": 0, "F": 1, "fill": 2} if policy.backward_first else {"F": 0, "back": 1, "fill": 2}
    limit = p.memory_limit if p.memory_limit is not None else math.inf
    # Stage 0 keeps B where it has a cost: its I would compute nothing, its W everything.
    split = {s for s in range(n) if policy.split and (s > 0 or (0, "B") not in p.costs)}

    def candidates(r: int) -> list[tuple[float, tuple, Op]]:
        out = []
        for s in local[r]:
            i = next_f[s]
            enters = s == local[r][0]
            room = (held[r] + reserved[r] + footprint[r] <= limit and (
                policy.in_flight is None or count[r] + reserved_count[r] + len(local[r]) <= policy.in_flight[r]))
            if i < m and (s == 0 or Op(s - 1, "F", i) in end) and (room or not enters):
                ready = end[Op(s - 1, "F", i)] + p.hop(s - 1, s) if s > 0 else 0.0
                out.append((ready, "F", Op(s, "F", i)))
            i = next_b[s]
            if i < m and Op(s, "F", i) in end:
                ready = end[Op(s, "F", i)]
                grad = None
                if s < n - 1:
                    grad = next((g for g in (Op(s + 1, "B", i), Op(s + 1, "I", i)) if g in end), None)
                if s == n - 1 or grad is not None:
                    if grad is not None:
                        ready = max(ready, end[grad] + p.hop(s + 1, s))
                    kind = "I" if s in split else "B"
                    out.append((ready, "fill" if policy.split and s == 0 and kind == "B" else "back", Op(s, kind, i)))
            if waiting_w[s]:
                i = waiting_w[s][0]
                out.append((end[Op(s, "I", i)], "fill", Op(s, "W", i)))
        picked = []
        for ready, cls, op in out:
            urgency = (classes[cls], op.microbatch + jitter.get((op.stage, op.microbatch), 0.0),
                       -op.stage if policy.deep_first else op.stage)
            picked.append((max(free[r], ready), urgency, op))
        return picked

    remaining = (2 * n + len(split)) * m
    while remaining:
        choice = None
        for r in range(p.pp):
            cands = candidates(r)
            if not cands:
                continue
            soonest = min(start for start, _, _ in cands)
            start, _, op = min((c for c in cands if c[0] <= soonest + policy.slack), key=lambda c: c[1])
            if choice is None or start < choice[0]:
                choice = (start, r, op)
        if choice is None:
            return None
        start, r, op = choice
        end[op] = start + p.costs[(op.stage, op.kind)]
        free[r] = end[op]
        order[r].append(op)
        remaining -= 1
        if op.kind == "F":
            next_f[op.stage] += 1
            held[r] += p.weight(op.stage)
            count[r] += 1
            if op.stage == local[r][0]:
                reserved[r] += footprint[r]
                reserved_count[r] += len(local[r])
            reserved[r] -= p.weight(op.stage)
            reserved_count[r] -= 1
        elif op.kind in "BI":
            next_b[op.stage] += 1
            if op.kind == "I":
                waiting_w[op.stage].append(op.microbatch)
        if op.kind in "BW":
            if op.kind == "W":
                waiting_w[op.stage].popleft()
            held[r] -= p.weight(op.stage)
            count[r] -= 1
    return order


def _policies(p: Problem, rng: random.Random, count: int) -> list[Policy]:
    """The zero-bubble paper's handcrafted points first (1F1B's in-flight count with B, then with
    I + W, then twice that count: ZB-H1 and ZB-H2 in spirit), then random ones."""
    v = p.num_stages // p.pp
    m = p.microbatches
    mean_cost = sum(v for v in p.costs.values()) / len(p.costs)

    def caps(base: int, slope: int) -> tuple[int, ...]:
        return tuple(min(v * m, max(v, base + slope * (p.pp - 1 - r))) for r in range(p.pp))

    one_f_one_b = caps(v, v)
    out = [Policy(False, True, True, one_f_one_b), Policy(True, True, True, one_f_one_b),
           Policy(True, True, True, tuple(2 * c for c in one_f_one_b)), Policy(True, True, True, None),
           Policy(False, False, True, None), Policy(True, True, False, one_f_one_b)]
    while len(out) < count:
        cap = None if rng.random() < 0.2 else caps(rng.randint(1, 2 * v), rng.randint(0, 2 * v))
        out.append(Policy(split=rng.random() < 0.6, backward_first=rng.random() < 0.8, deep_first=rng.random() < 0.5,
                          in_flight=cap, slack=rng.choice([0.0, 0.0, 0.25, 0.5, 1.0]) * mean_cost,
                          noise=rng.choice([0.0, 0.0, 0.5, 1.5])))
    usable = [pol for pol in out if (p.splits if pol.split else p.whole)]
    return usable[:max(count, 0)]


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
    makespan_s: float  # jitter-free simulated pipeline
    lower_bound_s: float
    origin: str  # the seed or heuristic the best order grew from
    evaluated: int  # orders simulated
    rejected: int  # of those: could not run, over the budget, or refused by ``check``
    improved_by_moves: int  # accepted local moves that made the best better
    seconds: float


def _score(p: Problem, order: Order) -> tuple[float, float] | None:
    """(makespan, peak held per rank): None when the order cannot run or exceeds the budget."""
    try:
        actions = simulate(order, p.costs, num_stages=p.num_stages, comm_s=p.comm_s)
    except ValueError:
        return None
    weights = dict(p.stage_bytes) if p.stage_bytes is not None else None
    peak = max(peak_in_flight(order, weights).values())
    if p.memory_limit is not None and peak > p.memory_limit:
        return None
    return max(a.end for a in actions), peak


def synthesize(p: Problem, *, seeds: Mapping[str, Order], budget: int = 200, seed: int | str = 0,
               check: Callable[[Order], None] | None = None) -> Synthesis | None:
    """The fastest order found among ``budget`` evaluated ones (seeds, then about half the budget
    in list schedules, then local moves from the best). ``check`` raises on an order the runtime
    would refuse (the planner passes torch's dry run of the CSV); a new best must pass it. None
    when no order fits the budget."""
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
    for policy in _policies(p, rng, budget // 2 - len(seeds)):
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
