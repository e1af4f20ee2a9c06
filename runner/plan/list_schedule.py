"""List schedules: an order built by simulating the ranks and letting each free rank pick its
next action by a policy (the zero-bubble paper's heuristics, Qi et al. 2024), within the memory
budget counted per action."""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, replace

from runner.pipeline.ops import Op
from runner.plan.problem import Order, Problem

__all__ = ["Policy", "list_schedule", "policies"]


@dataclass(frozen=True)
class Policy:
    """How a list schedule picks a rank's next action among the ready ones."""

    split: bool  # I then W instead of B (stage 0 keeps B: its I would compute nothing)
    backward_first: bool  # a ready B/I before a ready F (1F1B-like); else forwards first (GPipe-like)
    deep_first: bool  # among ready actions of one kind and microbatch, the later stage first
    in_flight: tuple[int, ...] | None = None  # per rank, at most this many stage-microbatches held
    slack: float = 0.0  # seconds a rank may wait for a more urgent action rather than start another
    noise: float = 0.0  # random jitter of microbatch priorities, for variety
    # Per rank, how many Ws wait before the next one is as urgent as a backward (ZB-H1 defers r of
    # them on rank r); the others wait for the rank's last backward (a W started in an idle slot
    # delays the forward arriving during it). With it, ``in_flight`` counts microbatches until
    # their I, not their W (a deferred W holds M_W, which the memory budget counts); None: Ws fill
    # idle slots.
    defer: tuple[int, ...] | None = None
    split_first: bool = False  # stage 0 splits too (its W can then wait, as the paper's schedules split it)

    def describe(self) -> str:
        caps = "memory" if self.in_flight is None else "/".join(map(str, self.in_flight))
        return (f"list({'I+W' if self.split else 'B'}, {'backward' if self.backward_first else 'forward'} first, "
                f"{'deep' if self.deep_first else 'shallow'} first, in flight {caps}, slack {self.slack * 1e3:.2f} ms"
                f"{f', noise {self.noise:.1f}' if self.noise else ''}"
                f"{', defer ' + '/'.join(map(str, self.defer)) if self.defer is not None else ''}"
                f"{', stage 0 split' if self.split_first else ''})")


def list_schedule(p: Problem, policy: Policy, rng: random.Random) -> Order | None:
    """Build an order by simulating the ranks and letting each free rank pick, among the actions
    it could start soonest (within ``policy.slack``), the most urgent by the policy: backward
    (B/I), forward and fill (W, and stage 0's deferred B when split) classes, then microbatch,
    then stage. A microbatch enters a rank (its forward on the rank's first stage) only while
    the budget holds it through all of the rank's stages on top of what the microbatches already
    inside may still take, so that those can always go on: no order it builds deadlocks on
    memory. None when the budget cannot hold one microbatch."""
    return _ListScheduler(p, policy, rng).run()


class _ListScheduler:
    """One list schedule's state: what each rank holds and has done, and what each stage does next."""

    def __init__(self, p: Problem, policy: Policy, rng: random.Random):
        self.p, self.policy = p, policy
        n, m = p.num_stages, p.microbatches
        self.local = {r: p.stages_on(r) for r in range(p.pp)}
        self.end: dict[Op, float] = {}
        self.order: Order = {r: [] for r in range(p.pp)}
        self.free = {r: 0.0 for r in range(p.pp)}
        self.held = {r: 0.0 for r in range(p.pp)}  # bytes (or stage-microbatches) of forwards not yet freed
        self.count = {r: 0 for r in range(p.pp)}  # stage-microbatches, for policy.in_flight
        # What the microbatches inside a rank will still take (their forwards on its later stages).
        self.reserved = {r: 0.0 for r in range(p.pp)}
        self.reserved_count = {r: 0 for r in range(p.pp)}
        self.footprint = {r: sum(p.weight(s) for s in self.local[r]) for r in range(p.pp)}
        self.next_f, self.next_b = [0] * n, [0] * n
        self.waiting_w: list[deque[int]] = [deque() for _ in range(n)]
        self.jitter = ({(s, i): rng.random() * policy.noise for s in range(n) for i in range(m)}
                       if policy.noise else {})
        self.classes = {"back": 0, "F": 1, "fill": 2} if policy.backward_first else {"F": 0, "back": 1, "fill": 2}
        self.limit = p.memory_limit if p.memory_limit is not None else math.inf
        # Stage 0 keeps B where it has a cost: its I would compute nothing, its W everything.
        self.split = {s for s in range(n)
                      if policy.split and (s > 0 or policy.split_first or (0, "B") not in p.costs)}

    def _may_enter(self, r: int) -> bool:
        """Whether the budget (and ``in_flight``) lets one more microbatch into rank ``r``."""
        fits = self.held[r] + self.reserved[r] + self.footprint[r] <= self.limit * (1 + 1e-9)
        cap = self.policy.in_flight
        return fits and (cap is None or self.count[r] + self.reserved_count[r] + len(self.local[r]) <= cap[r])

    def _ready_actions(self, r: int) -> list[tuple[float, str, Op]]:
        """(when its inputs exist, its class, the action) of each action rank ``r`` could do next."""
        p, end, m, last = self.p, self.end, self.p.microbatches, self.p.num_stages - 1
        out = []
        for s in self.local[r]:
            i = self.next_f[s]
            enters = s == self.local[r][0]
            if i < m and (s == 0 or Op(s - 1, "F", i) in end) and (not enters or self._may_enter(r)):
                ready = end[Op(s - 1, "F", i)] + p.hop(s - 1, s) if s > 0 else 0.0
                out.append((ready, "F", Op(s, "F", i)))
            i = self.next_b[s]
            if i < m and Op(s, "F", i) in end:
                grad = next((g for g in (Op(s + 1, "B", i), Op(s + 1, "I", i)) if g in end), None)
                if s == last or grad is not None:
                    ready = end[Op(s, "F", i)]
                    if grad is not None:
                        ready = max(ready, end[grad] + p.hop(s + 1, s))
                    kind = "I" if s in self.split else "B"
                    fill = self.policy.split and s == 0 and kind == "B"  # stage 0's B can wait: nothing needs it
                    out.append((ready, "fill" if fill else "back", Op(s, kind, i)))
            if self.waiting_w[s]:
                i = self.waiting_w[s][0]
                defer = self.policy.defer
                urgent = defer is not None and len(self.waiting_w[s]) > defer[r]
                if urgent or defer is None or all(self.next_b[t] == m for t in self.local[r]):
                    out.append((end[Op(s, "I", i)], "back" if urgent else "fill", Op(s, "W", i)))
        return out

    def _pick(self, r: int) -> tuple[float, Op] | None:
        """Rank ``r``'s next action and its start: the most urgent of those it could start soonest."""
        cands = []
        for ready, cls, op in self._ready_actions(r):
            urgency = (self.classes[cls], op.microbatch + self.jitter.get((op.stage, op.microbatch), 0.0),
                       -op.stage if self.policy.deep_first else op.stage)
            cands.append((max(self.free[r], ready), urgency, op))
        if not cands:
            return None
        soonest = min(start for start, _, _ in cands)
        start, _, op = min((c for c in cands if c[0] <= soonest + self.policy.slack), key=lambda c: c[1])
        return start, op

    def _record(self, r: int, op: Op, start: float) -> None:
        """Rank ``r`` runs ``op`` from ``start``: its order, time and memory move on."""
        p = self.p
        self.end[op] = start + p.costs[(op.stage, op.kind)]
        self.free[r] = self.end[op]
        self.order[r].append(op)
        if op.kind == "F":
            self.next_f[op.stage] += 1
            self.held[r] += p.weight(op.stage)
            self.count[r] += 1
            if op.stage == self.local[r][0]:
                self.reserved[r] += self.footprint[r]
                self.reserved_count[r] += len(self.local[r])
            self.reserved[r] -= p.weight(op.stage)
            self.reserved_count[r] -= 1
        elif op.kind in "BI":
            self.next_b[op.stage] += 1
            if op.kind == "I":
                self.waiting_w[op.stage].append(op.microbatch)
        self.held[r] -= p.freed(op)
        if op.kind == "W":
            self.waiting_w[op.stage].popleft()
        if op.kind == "B" or op.kind == ("I" if self.policy.defer is not None else "W"):
            self.count[r] -= 1

    def run(self) -> Order | None:
        # Each rank's pick, recomputed only where the last action changed what that rank can do: its
        # own rank, and the ranks its output feeds (the next stage's forward, the previous stage's
        # backward). At p = 32 this is most of the search's time.
        p = self.p
        picks = {r: self._pick(r) for r in range(p.pp)}
        remaining = (2 * p.num_stages + len(self.split)) * p.microbatches
        while remaining:
            choice = None
            for r, picked in picks.items():
                if picked is not None and (choice is None or picked[0] < choice[0]):
                    choice = (picked[0], r, picked[1])
            if choice is None:
                return None
            start, r, op = choice
            fed = op.stage + 1 if op.kind == "F" else op.stage - 1 if op.kind in "BI" else op.stage
            self._record(r, op, start)
            remaining -= 1
            for q in {r, p.stage_to_rank.get(fed, r)}:
                picks[q] = self._pick(q)
        return self.order


def policies(p: Problem, rng: random.Random, count: int) -> list[Policy]:
    """The zero-bubble paper's handcrafted points first (1F1B's in-flight count with B, then with
    I + W; ZB-H1: 1F1B's count until the I, rank r deferring r Ws; ZB-H2 in spirit: twice the
    count), then random ones."""
    v = p.num_stages // p.pp
    m = p.microbatches
    mean_cost = sum(v for v in p.costs.values()) / len(p.costs)

    def caps(base: int, slope: int) -> tuple[int, ...]:
        return tuple(min(v * m, max(v, base + slope * (p.pp - 1 - r))) for r in range(p.pp))

    one_f_one_b = caps(v, v)
    ranks = range(p.pp)
    # Its own draws, seeded from (not drawing from) ``rng``: the other draws stay as they were.
    deferring = random.Random(str(rng.getstate()[1][:8]))
    out = [Policy(False, True, True, one_f_one_b), Policy(True, True, True, one_f_one_b),
           Policy(True, True, True, one_f_one_b, defer=tuple(v * r for r in ranks)),
           Policy(True, True, True, tuple(2 * c for c in one_f_one_b)), Policy(True, True, True, None),
           Policy(False, False, True, None), Policy(True, True, False, one_f_one_b)]
    while len(out) < count:
        cap = None if rng.random() < 0.2 else caps(rng.randint(1, 2 * v), rng.randint(0, 2 * v))
        out.append(Policy(split=rng.random() < 0.6, backward_first=rng.random() < 0.8, deep_first=rng.random() < 0.5,
                          in_flight=cap, slack=rng.choice([0.0, 0.0, 0.25, 0.5, 1.0]) * mean_cost,
                          noise=rng.choice([0.0, 0.0, 0.5, 1.5]),
                          defer=None if deferring.random() < 0.5 else tuple(
                              deferring.randint(0, v) + deferring.randint(0, v) * r for r in ranks)))
    if not p.barrier and all((0, k) in p.costs for k in "IW"):
        # Steps overlap: rank 0 may split and end on put-off Ws too, while the next step's forwards
        # travel. The handcrafted split points both ways, then a coin per random one (its own draws).
        coin = random.Random(str(rng.getstate()[1][8:16]))
        out = [out[0], *(replace(pol, split_first=True) for pol in out[1:5]), *out[1:7],
               *(replace(pol, split_first=pol.split and coin.random() < 0.5) for pol in out[7:])]
    usable = [pol for pol in out if (p.splits if pol.split else p.whole)]
    return usable[:max(count, 0)]
