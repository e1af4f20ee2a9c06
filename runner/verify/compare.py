"""``verify``'s comparisons: the run's numbers against the unsplit reference's, tensors and floats
in, a report out (``passed``, the largest differences, the problems by name). Nothing here runs a
model or a collective (``runner.verify.hook`` does), so each rule is tested in-process.

Gradient tolerances do not carry over to weights after an Adam step: an early update is about
lr x sign(g), so a gradient element near zero whose sign rounding flips moves its weight by up to
2 lr, while a double or skipped update moves nearly every element by about lr. Weights are
therefore compared in units of the step's learning rate, by the fraction of elements off.

A first step that fails ``TOLERANCES`` may still be rounding, where the computation's own rounding
is larger than the tolerances assume: a gradient summed from terms far larger than itself (a zero
embedding row amplified by RMSNorm's 1/sqrt(eps) gives Qwen2's value bias gradients of ~4000 from
summands larger still, where another layout's order of the same sums differs by 1.8e-5 relative).
``compare`` then asks for the exact answer (``exact``: the unsplit step rerun in float64,
``runner.verify.exact``) and measures each failed tensor's rounding scale by the unsplit fp32
model's own error against it: the run's error is admitted within ``ROUNDING_FACTOR`` of that noise
(``_admit``). Both errors are of the same kind (one fp32 computation's sums in one order), so a
correct layout's error is a small multiple of the reference's, while a defect (a microbatch missing
or scaled, a tensor applied to the wrong stage) is off by its own size, orders of magnitude beyond
rounding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

__all__ = ["TOLERANCES", "WEIGHT_TOLERANCES", "DRIFT", "ROUNDING_FACTOR", "REPRODUCED", "Exact", "compare",
           "compare_weights", "compare_drift", "rounding_line"]

# (rtol, atol) per train.precision. fp32: those of torch's own test_schedule_multiproc.py. bf16:
# an 8-bit mantissa (relative step 2**-8) and reductions in another order per layout.
TOLERANCES = {"fp32": (1e-5, 4e-5), "bf16": (5e-2, 2e-3)}
# Weights after an update: (how far an element may be off, in units of the step's learning rate;
# the fraction of the model's elements that may be further off). A double or skipped update moves
# nearly every element by about lr; a sign flip of a gradient element at rounding level, up to 2 lr.
WEIGHT_TOLERANCES = {"fp32": (0.5, 0.01), "bf16": (0.5, 0.05)}
# Relative difference allowed in the loss and the global gradient norm once the weights have been
# updated (steps 2..K+1): the weights then differ by rounding and its sign flips.
DRIFT = {"fp32": 1e-4, "bf16": 2e-2}
# How far past the unsplit fp32 model's own error against float64 (per tensor, its largest element's)
# the run's may be: two fp32 computations of the same sums in different orders (tp partial sums,
# microbatches accumulated per stage) have errors of the same scale, whose maxima over a tensor
# differ by a small factor (measured over every tensor of two padded Qwen2 runs at pp=2 x tp=2: at
# most 1.7, median 0.8-1.0; docs/verify.md); a defect is off by its own size (one microbatch's loss
# scaled by 1.001: 1000-2000 x the noise). 10 leaves 6 x room over the largest ratio seen.
ROUNDING_FACTOR = 10.0
# The float64 rerun must reproduce the fp32 reference's loss to this relative difference, or what
# separates them is not rounding (dropout's masks, another batch) and the strict verdict stands.
REPRODUCED = 1e-4


@dataclass
class Exact:
    """The unsplit model's first step rerun in float64 (``runner.verify.exact``): its loss, and
    every gradient by full name (float64 tensors)."""

    loss: float
    grads: dict[str, torch.Tensor]


# What ``compare`` may ask for when the strict check fails: the float64 rerun, or why there is none.
ExactFn = Callable[[], Union[Exact, str]]


def compare(
    got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None], loss: float, ref_loss: float,
    *, rtol: float = TOLERANCES["fp32"][0], atol: float = TOLERANCES["fp32"][1], exact: ExactFn | None = None,
) -> dict:
    """Largest absolute and relative gradient differences; ``passed`` as ``torch.allclose``
    with ``rtol``/``atol`` on the loss and on every gradient, and no gradient missing.
    ``tolerance_used``: the largest difference as a fraction of its element's tolerance
    (``atol + rtol * |ref|``), at most 1 where it passed; the relative difference alone is
    large wherever a gradient is near zero, which the ``atol`` admits.

    ``exact``: called (once) only where the loss or a gradient fails that check, for the float64
    rerun (or why there is none): a failed value is then admitted as rounding within
    ``ROUNDING_FACTOR`` of the unsplit model's own error against it (``_admit``). ``rounding`` in
    the report: what the rerun found (None where nothing failed or no ``exact`` was given)."""
    problems = [f"{n}: no gradient in the pipeline" for n in ref if got.get(n) is None and ref[n] is not None]
    problems += [f"{n}: not in the unsplit model" for n in got if n not in ref]
    max_abs = max_rel = used = 0.0
    worst = None
    failed: dict[str, float] = {}  # name -> its largest difference
    for name, r in ref.items():
        g = got.get(name)
        if g is None or r is None:
            continue
        diff = (g - r).abs()
        rel = (diff / r.abs().clamp_min(1e-12)).max().item()
        if diff.max().item() > max_abs:
            max_abs, worst = diff.max().item(), name
        max_rel = max(max_rel, rel)
        used = max(used, (diff / (atol + rtol * r.abs())).max().item()) if diff.numel() else used
        if not torch.allclose(g, r, rtol=rtol, atol=atol):
            failed[name] = diff.max().item()
    loss_diff = abs(loss - ref_loss)
    loss_failed = loss_diff > atol + rtol * abs(ref_loss)
    rounding = None
    if (failed or loss_failed) and exact is not None:
        values = {**{n: (got[n], ref[n]) for n in failed}, **({LOSS: (loss, ref_loss)} if loss_failed else {})}
        rounding = _rounding(values, ref_loss, exact(), rtol=rtol, atol=atol)
    beyond = rounding["beyond"] if rounding else {}
    problems += [f"{name}: max abs diff {d:.3g}{_numbers(beyond.get(name))}" for name, d in failed.items()
                 if not rounding or name not in rounding["admitted"]]
    if loss_failed and (not rounding or LOSS not in rounding["admitted"]):
        problems.append(f"loss {loss:.6f} vs unsplit {ref_loss:.6f}{_numbers(beyond.get(LOSS))}")
    return {
        "passed": not problems,
        "loss": loss,
        "ref_loss": ref_loss,
        "loss_abs_diff": loss_diff,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "tolerance_used": used,
        "worst_param": worst,
        "rtol": rtol,
        "atol": atol,
        "rounding": rounding,
        "problems": problems[:20],
    }


LOSS = "(loss)"  # the loss among the values ``_rounding`` judges (no parameter's name has parentheses)


def _rounding(values: dict[str, tuple], ref_loss: float, exact: Exact | str, *, rtol: float, atol: float) -> dict:
    """The failed ``values`` (name -> the run's and the unsplit model's) against the float64 rerun:
    ``admitted`` and ``beyond`` (name -> ``unsplit_off``, ``run_off``: each one's largest
    difference from float64), and ``float64``: "rerun", or why it was not used."""
    out: dict = {"float64": "rerun", "factor": ROUNDING_FACTOR, "admitted": {}, "beyond": {}}
    if isinstance(exact, str):
        return {**out, "float64": exact}
    rel = abs(ref_loss - exact.loss) / max(abs(exact.loss), 1e-12)
    if rel > REPRODUCED:
        return {**out, "float64": f"not used: its loss {exact.loss:.6g} is not the unsplit model's {ref_loss:.6g} "
                                  f"(relative difference {rel:.2g} > {REPRODUCED:g}), so what they differ by is "
                                  f"not rounding"}
    for name, (g, r) in values.items():
        e = exact.loss if name == LOSS else exact.grads.get(name)
        if e is not None:
            admitted, numbers = _admit(torch.as_tensor(g), torch.as_tensor(r), torch.as_tensor(e), rtol=rtol, atol=atol)
            out["admitted" if admitted else "beyond"][name] = numbers
    return out


def _admit(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, *, rtol: float, atol: float,
           factor: float = ROUNDING_FACTOR) -> tuple[bool, dict[str, float]]:
    """Whether ``got`` (the run's tensor) is rounding: every element within its strict tolerance of
    the float64 value plus ``factor`` x the tensor's noise, the unsplit fp32 model's largest error
    against float64 (``ref``'s). The noise is the tensor's, not each element's: an element's own
    error can be zero by luck, and the summands that set the rounding scale are shared by the
    tensor's elements (one matmul), not by its smallest results."""
    got, ref, exact = got.double(), ref.double(), exact.double()
    noise = (ref - exact).abs().max().item()
    off = (got - exact).abs()
    admitted = bool((off <= atol + rtol * exact.abs() + factor * noise).all())
    return admitted, {"unsplit_off": noise, "run_off": off.max().item()}


def rounding_line(rounding: dict) -> str:
    """``compare``'s ``rounding`` in a sentence, for the console and the summary's table."""
    admitted = rounding["admitted"]
    if rounding["float64"] != "rerun":
        return f"float64 rerun {rounding['float64']}"
    if not admitted:
        return "float64 rerun: no difference was within rounding"
    name, worst = max(admitted.items(), key=lambda item: item[1]["run_off"] / max(item[1]["unsplit_off"], 1e-300))
    what = "loss" if name == LOSS else f"gradient of {name}"
    return (f"rounding admitted {len(admitted)} value(s) (float64 rerun): the unsplit model's own fp32 {what} "
            f"is off float64 by {worst['unsplit_off']:.3g}, this run's by {worst['run_off']:.3g} (at most "
            f"{rounding['factor']:g} x admitted)")


def _numbers(numbers: dict[str, float] | None) -> str:
    """A failed value's rounding figures, for its problem; nothing where there are none."""
    if numbers is None:
        return ""
    return (f" (off float64 by {numbers['run_off']:.3g}; the unsplit model's own fp32 rounding: "
            f"{numbers['unsplit_off']:.3g}, at most {ROUNDING_FACTOR:g} x that admitted)")


def compare_weights(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor], lr: float, *,
                    max_lr_units: float = WEIGHT_TOLERANCES["fp32"][0],
                    max_fraction: float = WEIGHT_TOLERANCES["fp32"][1]) -> dict:
    """The weights after an update, in units of its learning rate ``lr``: fails when more than
    ``max_fraction`` of all the elements compared differ from the unsplit model's by more than
    ``max_lr_units`` x lr, naming the tensors with most of them. Counted over the whole model, not
    per tensor: an element whose true gradient is zero (a key projection's bias: softmax ignores a
    constant added to every score) is updated by the sign of rounding noise, which in bf16 or on
    large sums outgrows AdamW's eps, so a small tensor can be half off in an exact layout."""
    problems = [f"{n}: not in the unsplit model" for n in got if n not in ref]
    off: dict[str, tuple[int, int, float]] = {}  # name -> elements beyond, elements, the largest (in lr)
    for name, w in got.items():
        if w is not None and name in ref:
            units = (w - ref[name]).abs() / max(lr, 1e-30)  # lr 0: any difference fails
            off[name] = (int((units > max_lr_units).sum()), units.numel(), units.max().item())
    fraction = sum(n for n, _, _ in off.values()) / max(1, sum(total for _, total, _ in off.values()))
    if fraction > max_fraction:
        problems.append(f"{fraction:.2%} of the weights differ by more than {max_lr_units:g} lr (lr {lr:.3g}; at "
                        f"most {max_fraction:.0%} may), most of them in:")
        ranked = sorted((item for item in off.items() if item[1][0]), key=lambda item: -item[1][0])
        problems += [f"{name}: {n / total:.1%} of its elements (at most {most:.3g} lr)"
                     for name, (n, total, most) in ranked[:20]]
        problems += [f"... and {len(ranked) - 20} more tensors"] if len(ranked) > 20 else []
    worst = max(off, key=lambda name: off[name][2], default=None)
    return {"passed": not problems, "lr": lr, "max_lr_units": off[worst][2] if worst else 0.0,
            "fraction_off": fraction, "worst_param": worst, "max_lr_units_allowed": max_lr_units,
            "max_fraction_allowed": max_fraction, "problems": problems}


def compare_drift(loss: float, ref_loss: float, grad_norm: float, ref_grad_norm: float, *,
                  rtol: float = DRIFT["fp32"]) -> dict:
    """A step's loss and global gradient norm (before clipping) against the unsplit model's, once
    updates have run: relative differences beyond ``rtol`` fail."""
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    norm_rel = abs(grad_norm - ref_grad_norm) / max(abs(ref_grad_norm), 1e-12)
    problems = [f"{what} {got:.6g} vs unsplit {want:.6g} (relative difference {rel:.2g} > {rtol:g})"
                for what, got, want, rel in [("loss", loss, ref_loss, loss_rel),
                                             ("gradient norm", grad_norm, ref_grad_norm, norm_rel)] if rel > rtol]
    return {"passed": not problems, "loss": loss, "ref_loss": ref_loss, "loss_rel_diff": loss_rel,
            "grad_norm": grad_norm, "ref_grad_norm": ref_grad_norm, "grad_norm_rel_diff": norm_rel, "rtol": rtol,
            "problems": problems}
