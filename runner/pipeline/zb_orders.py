"""The Zero Bubble paper's handcrafted schedules (Qi et al., ICLR 2024, arXiv 2401.10241, section 3.1)
as per-rank action orders: one stage per rank (stage r on rank r), each backward split into its
input gradient (I) and its weight gradient (W).

Both have one shape. Rank r runs ``warm-up`` forwards, then, for each microbatch k in turn, I of k,
the W it has put off until then (that of k - ``delay``), and the next forward while one is left;
the W's still owed close the step.

* ZB-H1, at 1F1B's memory: 1F1B's warm-up (p - r forwards) and W's put off by r, so rank r holds
  p microbatches at most (an I frees less than its W needs; the count holds a microbatch until its
  W). With equal F, B and W it reaches the step's lower bound; in general its bubble is
  (p - 1)(T_F + T_B - T_W) instead of 1F1B's (p - 1)(T_F + T_B + T_W). It is the order torch's
  ``ScheduleInterleavedZeroBubble`` builds for one stage per rank (the tests compare the two).
* ZB-H2, at (2p - 1) microbatches' memory: the warm-up runs 2(p - r) - 1 forwards, as many as fit
  before the first input gradient comes back, and W's are put off by 2r, which moves 2r + 1 of them
  to the end of the step, where the ranks nearer the first stage wait for the last input gradients:
  every rank holds 2p - 1 microbatches at most, and the step comes to about m(T_F + T_B + T_W) plus
  p - 1 forwards (and their messages), the least a step can take. That remaining bubble is the
  forward ramp (rank r waits r forwards before its first) and its mirror at the end; the paper's
  zero needs the next step's forwards to start before this step's optimizer (their optimizer
  post-validation), whereas the runner clips and checks for non-finite values over all ranks before
  the optimizer steps, so its step keeps that bubble.

Their full shapes need m >= p (ZB-H1) and m >= 2p - 1 (ZB-H2) microbatches. With fewer, the
warm-up is cut to the m forwards there are: still a valid order (the synthesizer may seed from it),
no longer the paper's, and the runner refuses those before launch (``runner.pipeline.registry`` holds the
counts). Imports no torch.
"""

from __future__ import annotations

from runner.pipeline.ops import Op

__all__ = ["zbh1_order", "zbh2_order"]


def _order(pp: int, microbatches: int, *, warmup: int, delay: int, rank: int) -> list[Op]:
    """One rank's order: ``warmup`` forwards, then per microbatch k: I of k, W of k - ``delay``, the
    next forward; then the W's still owed."""
    warmup = min(warmup, microbatches)
    ops = [Op(rank, "F", mb) for mb in range(warmup)]
    next_w = 0  # the first microbatch whose W has not run
    for k in range(microbatches):
        ops.append(Op(rank, "I", k))
        if k >= delay:
            ops.append(Op(rank, "W", k - delay))
            next_w = k - delay + 1
        if warmup + k < microbatches:
            ops.append(Op(rank, "F", warmup + k))
    ops += [Op(rank, "W", mb) for mb in range(next_w, microbatches)]
    return ops


def _check(pp: int, microbatches: int) -> None:
    if pp < 1 or microbatches < 1:
        raise ValueError(f"pp={pp} and microbatches={microbatches} must both be at least 1")


def zbh1_order(pp: int, microbatches: int) -> dict[int, list[Op]]:
    """ZB-H1: rank -> its actions (stage r on rank r); 1F1B's warm-up, rank r's W's put off by r."""
    _check(pp, microbatches)
    return {r: _order(pp, microbatches, warmup=pp - r, delay=r, rank=r) for r in range(pp)}


def zbh2_order(pp: int, microbatches: int) -> dict[int, list[Op]]:
    """ZB-H2: rank -> its actions (stage r on rank r); 2(p - r) - 1 forwards of warm-up, rank r's W's
    put off by 2r."""
    _check(pp, microbatches)
    return {r: _order(pp, microbatches, warmup=2 * (pp - r) - 1, delay=2 * r, rank=r) for r in range(pp)}

