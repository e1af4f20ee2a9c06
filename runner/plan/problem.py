"""What a schedule is searched for (``Problem``: costs, placement, messages and the memory each
action holds), and the lower bound no order of its actions can beat."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from runner.pipeline.ops import Op

__all__ = ["Order", "Problem", "lower_bound"]

Order = dict[int, list[Op]]


@dataclass(frozen=True)
class Problem:
    """What the order is searched for: costs of (stage, F/B/I/W) in seconds, the stage placement,
    the cost of a message between ranks, and the activation budget per rank."""

    microbatches: int
    stage_to_rank: Mapping[int, int]
    costs: Mapping[tuple[int, str], float]
    comm_s: float = 0.0
    # Bytes one stage-microbatch's forward keeps (M_B) until its backward frees them: a B all of
    # them, an I all but ``weight_grad_fraction`` of them (M_W / M_B: what the weight gradient
    # still needs), its W the rest. None counts stage-microbatches instead. ``memory_limit`` is
    # in the same unit, per rank.
    stage_bytes: Mapping[int, float] | None = None
    memory_limit: float | None = None
    weight_grad_fraction: float = 1.0
    # True: a step ends when every rank is done (today's runs), scored by the makespan. False: steps
    # overlap (the Zero Bubble paper's post-validation): the search scores the longest rank's span
    # within a step (``rank_span``, the paper's measure), whose floor is the busiest rank's compute,
    # and re-scores its finalists by the steady step (``deferred_step``: ``synthesize.rescore``).
    barrier: bool = True
    # The tied weights' gradient sums (``runner.plan.link.tied_meetings``: the ranks holding a copy
    # and the seconds of their all-reduce): with the barrier the step ends after them, as the plan
    # predicts it; without it the finalists' steady step holds them.
    meetings: tuple[tuple[tuple[int, ...], float], ...] = ()

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

    def freed(self, op: Op) -> float:
        """What ``op`` frees of its stage-microbatch's activations (a forward frees nothing)."""
        share = {"F": 0.0, "B": 1.0, "I": 1.0 - self.weight_grad_fraction, "W": self.weight_grad_fraction}[op.kind]
        return share * self.weight(op.stage)

    def one_f_one_b_memory(self) -> float:
        """1F1B's memory as the zero-bubble paper limits its schedules: p microbatches of the
        rank's stages held on every rank (1F1B itself holds p - r on rank r; with those per-rank
        caps, ZB-H1, which holds p M_B on rank 0 and fewer M_B plus deferred M_W elsewhere, would
        not fit)."""
        return self.pp * max(sum(self.weight(s) for s in self.stages_on(r)) for r in range(self.pp))

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
    """Without the barrier (``p.barrier`` false), the busiest rank's compute: m(F+B+W) for one
    stage per rank. With it, no order of these actions on this placement finishes sooner: the larger of one
    microbatch's path through every forward and back, and, per rank, its compute (each backward
    at the cheaper of B and I + W) after the first forward can reach it, plus what must follow
    its last action (the rest of that gradient's path, or the extra a split backward costs when
    the rank ends on a W)."""
    n, m = p.num_stages, p.microbatches

    def c(s: int, kind: str) -> float:  # an action without a cost cannot be used
        return p.costs.get((s, kind), math.inf)

    back = {s: min(c(s, "B"), c(s, "I") + c(s, "W")) for s in range(n)}
    if not p.barrier:  # steps overlap: nothing waits for the ramps, only each rank's own compute
        return max(sum(m * (c(s, "F") + back[s]) for s in p.stages_on(r)) for r in range(p.pp))
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

