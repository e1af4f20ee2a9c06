"""Round schedules: an order built microbatch round by microbatch round, each action timed as it
is placed, in the spirit of the zero-bubble paper's automatic ZB-1p/ZB-2p (Qi et al. 2024, section
3): each stage first runs as many forwards as fit before its first gradient can arrive (within
the memory budget, fewer on each later stage); then round i gives every stage its next forward
(first stage to last) and microbatch i's input gradient (last stage to first); a stage's weight
gradients (W) wait for the gaps in which it would otherwise idle, or for the memory a forward
needs, and the rest close the step. Placing round by round means every action's inputs are
timed before the action is placed, so a W goes where it ends before the next action can start.

One stage per rank, scored without the barrier (``Problem.barrier`` false): the seeds the search
starts from where steps overlap. The construction is ours; the paper's code is not used.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import product

from runner.pipeline.ops import Op
from runner.plan.problem import Order, Problem

__all__ = ["Rounds", "round_schedule", "round_variants"]


@dataclass(frozen=True)
class Rounds:
    """How a round schedule decides: ``early_stop`` ends a stage's warm-up once its next forward
    would end after the first gradient arrives (else: once it is free at or after the arrival);
    ``eager_w`` puts a W into a gap too short for it (it then delays the next action a little
    rather than leaving the rank idle); ``split_first``: stage 0 splits its backward too (its Ws
    can then fill the cool-down); ``fewer`` forwards than fit in each stage's warm-up."""

    early_stop: bool
    eager_w: bool
    split_first: bool
    fewer: int = 0

    def describe(self) -> str:
        return (f"rounds({'fit' if self.early_stop else 'until'} the first gradient"
                f"{', eager W' if self.eager_w else ''}{', stage 0 split' if self.split_first else ''}"
                f"{f', {self.fewer} fewer' if self.fewer else ''})")


def round_variants(p: Problem) -> list[Rounds]:
    """The round schedules worth trying for ``p``: none where it has several stages on a rank or
    cannot split a backward (stage 0 splits where it has I and W costs, keeps B where it has B's)."""
    if sorted(p.stage_to_rank.values()) != list(range(p.num_stages)) or not p.splits:
        return []
    splits_first = [True] * all((0, k) in p.costs for k in "IW") + [False] * ((0, "B") in p.costs)
    return [Rounds(early, eager, first, fewer) for fewer, early, eager, first
            in product((0, 1, 2), (True, False), (True, False), splits_first)]


def round_schedule(p: Problem, rounds: Rounds) -> Order | None:
    """The order ``rounds`` builds for ``p`` (one stage per rank); None where the memory budget
    holds no microbatch, or a forward finds no W left to free the memory it needs."""
    return _Builder(p, rounds).run()


class _Builder:
    """One round schedule's state: per stage, when it is free, what it holds and has done."""

    def __init__(self, p: Problem, rounds: Rounds):
        self.p, self.rounds = p, rounds
        n = p.num_stages
        self.rank_of = {s: p.stage_to_rank[s] for s in range(n)}
        self.split = [s > 0 or rounds.split_first for s in range(n)]
        self.free = [0.0] * n
        self.held = [0.0] * n
        self.end: dict[Op, float] = {}
        self.ops: list[list[Op]] = [[] for _ in range(n)]
        self.waiting: list[deque[int]] = [deque() for _ in range(n)]
        self.limit = p.memory_limit * (1 + 1e-9) if p.memory_limit is not None else math.inf

    def cost(self, s: int, kind: str) -> float:
        return self.p.costs[(s, kind)]

    def ready(self, op: Op) -> float:
        """When ``op``'s inputs are on its stage's rank (they are placed before it)."""
        s, kind, i = op
        if kind == "F":
            return 0.0 if s == 0 else self.end[Op(s - 1, "F", i)] + self.p.hop(s - 1, s)
        if kind == "W":
            return self.end[Op(s, "I", i)]
        at = self.end[Op(s, "F", i)]
        if s < self.p.num_stages - 1:
            grad = Op(s + 1, "I" if self.split[s + 1] else "B", i)
            at = max(at, self.end[grad] + self.p.hop(s + 1, s))
        return at

    def place(self, op: Op) -> None:
        s = op.stage
        self.end[op] = self.free[s] = max(self.free[s], self.ready(op)) + self.cost(s, op.kind)
        self.ops[s].append(op)
        if op.kind == "F":
            self.held[s] += self.p.weight(s)
        else:
            self.held[s] -= self.p.freed(op)
        if op.kind == "I":
            self.waiting[s].append(op.microbatch)
        elif op.kind == "W":
            self.waiting[s].popleft()

    def fill(self, op: Op) -> bool:
        """Ws on ``op``'s stage before it: those its memory needs, then those that end before its
        inputs arrive (and one more with ``eager_w`` while the rank would idle). False when the
        memory cannot be freed."""
        s = op.stage
        need = self.p.weight(s) if op.kind == "F" else 0.0
        while self.held[s] + need > self.limit:
            if not self.waiting[s]:
                return False
            self.place(Op(s, "W", self.waiting[s][0]))
        ready, w = self.ready(op), self.cost(s, "W")
        while self.waiting[s] and self.free[s] + w <= ready:
            self.place(Op(s, "W", self.waiting[s][0]))
        if self.rounds.eager_w and self.waiting[s] and self.free[s] < ready:
            self.place(Op(s, "W", self.waiting[s][0]))
        return True

    def warm_up(self) -> list[int]:
        """Per stage, how many forwards it runs before its first backward: as many as end (or
        start, without ``early_stop``) before microbatch 0's gradient can arrive, within memory,
        at least one fewer than the stage before, less ``fewer``."""
        p, n, m = self.p, self.p.num_stages, self.p.microbatches
        f_end = [[0.0] * m for _ in range(n)]  # each stage running forwards only
        for s in range(n):
            for k in range(m):
                arrive = 0.0 if s == 0 else f_end[s - 1][k] + p.hop(s - 1, s)
                f_end[s][k] = max(f_end[s][k - 1] if k else 0.0, arrive) + self.cost(s, "F")
        counts = [1] * n
        grad_at = math.inf  # when microbatch 0's gradient reaches stage s
        for s in reversed(range(n)):
            k = 1
            if s < n - 1:
                while (k < m and (k + 1) * p.weight(s) <= self.limit
                       and (f_end[s][k] <= grad_at if self.rounds.early_stop else f_end[s][k - 1] < grad_at)):
                    k += 1
            counts[s] = k
            back = self.cost(s, "I" if self.split[s] else "B") + (p.hop(s, s - 1) if s else 0.0)
            grad_at = (f_end[s][k - 1] if s == n - 1 else max(f_end[s][k - 1], grad_at)) + back
        for s in range(1, n):
            counts[s] = max(1, min(counts[s], counts[s - 1] - 1))
        return [max(1, min(c - self.rounds.fewer, m)) if s < n - 1 else c for s, c in enumerate(counts)]

    def run(self) -> Order | None:
        p, n, m = self.p, self.p.num_stages, self.p.microbatches
        if any(p.weight(s) > self.limit for s in range(n)):
            return None
        warm = self.warm_up()
        for k in range(max(warm)):
            for s in range(n):
                if k < warm[s]:
                    self.place(Op(s, "F", k))
        nxt = list(warm)
        for i in range(m):
            if i:
                for s in range(n):
                    if nxt[s] < m:
                        if not self.fill(Op(s, "F", nxt[s])):
                            return None
                        self.place(Op(s, "F", nxt[s]))
                        nxt[s] += 1
            for s in reversed(range(n)):
                op = Op(s, "I" if self.split[s] else "B", i)
                self.fill(op)
                self.place(op)
        for s in range(n):
            while self.waiting[s]:
                self.place(Op(s, "W", self.waiting[s][0]))
        return {self.rank_of[s]: ops for s, ops in enumerate(self.ops)}
