"""Bytes between ranks, priced one way wherever a step is predicted: a message on a link
(``Link.seconds``: its latency, then its bytes at the link's bandwidth) and a ring all-reduce over
n ranks (``ring_all_reduce_s``: 2(n - 1) messages in turn, each of 1/n of the bytes; an all-gather
is its second half). The tied weights' gradient sums (``Layout.tied``) are such all-reduces
between the pipeline ranks holding a copy (``tied_meetings``), whichever comm model the caller has:
the planner's calibration (``Calibration.all_reduce_link``), ``plan.target``'s link, or the
rehearsal's ``plan.comm_*``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Sequence

from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.layout import TiedSpan

__all__ = ["Link", "DEFAULT_LINK", "configured_link", "ring_all_reduce_s", "tied_meetings"]


class Link(NamedTuple):
    latency_s: float  # one message (one hop of a ring), whatever its size
    bandwidth: float  # bytes/s beyond the latency

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


DEFAULT_LINK = Link(10e-6, 50e9)  # a 400 Gbit/s link per device


def configured_link(latency_s: float | None, bandwidth: float | None) -> Link:
    """``plan.comm_latency_s`` / ``plan.comm_bandwidth``, each null one ``DEFAULT_LINK``'s; a
    negative latency or a bandwidth that is not positive is a ``ConfigError`` (a zero bandwidth
    divided by zero, a negative one made every step negative)."""
    link = Link(DEFAULT_LINK.latency_s if latency_s is None else float(latency_s),
                DEFAULT_LINK.bandwidth if bandwidth is None else float(bandwidth))
    if not (math.isfinite(link.latency_s) and link.latency_s >= 0):
        raise ConfigError(f"plan.comm_latency_s={link.latency_s:g}: a message's latency is a time of 0 seconds or "
                          f"more. Fix: e.g. plan.comm_latency_s={DEFAULT_LINK.latency_s:g}, or null for that default.")
    if not (math.isfinite(link.bandwidth) and link.bandwidth > 0):
        raise ConfigError(f"plan.comm_bandwidth={link.bandwidth:g}: a link's bandwidth is a positive number of "
                          f"bytes/s. Fix: e.g. plan.comm_bandwidth={DEFAULT_LINK.bandwidth:g}, or null for that "
                          "default.")
    return link


def ring_all_reduce_s(nbytes: float, ranks: int, link: Link, *, gather: bool = False) -> float:
    """A ring all-reduce of ``nbytes`` between ``ranks`` ranks on ``link``: 2 (ranks - 1) messages
    in turn, each of 1 / ranks of the bytes (``gather``: an all-gather, the ring's second half,
    ranks - 1 of them). One rank sends nothing."""
    hops = (ranks - 1) * (1 if gather else 2)
    return hops * link.seconds(nbytes / ranks) if ranks > 1 else 0.0


def tied_meetings(tied: Sequence[TiedSpan], link: Link) -> list[tuple[tuple[int, ...], float]]:
    """The tied weights' gradient sums (``Layout.tied``) as ``runner.pipeline.simulate``'s meetings:
    each span's ranks and the ring all-reduce of its gradient bytes between them on ``link``."""
    return [(span.ranks, ring_all_reduce_s(span.grad_bytes, len(span.ranks), link)) for span in tied]
