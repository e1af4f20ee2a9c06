"""``verify``'s comparisons: the run's numbers against the unsplit reference's, tensors and floats
in, a report out (``passed``, the largest differences, the problems by name). Nothing here runs a
model or a collective (``runner.verify.hook`` does), so each rule is tested in-process.

Gradient tolerances do not carry over to weights after an Adam step: an early update is about
lr x sign(g), so a gradient element near zero whose sign rounding flips moves its weight by up to
2 lr, while a double or skipped update moves nearly every element by about lr. Weights are
therefore compared in units of the step's learning rate, by the fraction of elements off."""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "WEIGHT_TOLERANCES", "DRIFT", "compare", "compare_weights", "compare_drift"]

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


def compare(
    got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None], loss: float, ref_loss: float,
    *, rtol: float = TOLERANCES["fp32"][0], atol: float = TOLERANCES["fp32"][1],
) -> dict:
    """Largest absolute and relative gradient differences; ``passed`` as ``torch.allclose``
    with ``rtol``/``atol`` on the loss and on every gradient, and no gradient missing.
    ``tolerance_used``: the largest difference as a fraction of its element's tolerance
    (``atol + rtol * |ref|``), at most 1 where it passed; the relative difference alone is
    large wherever a gradient is near zero, which the ``atol`` admits."""
    problems = [f"{n}: no gradient in the pipeline" for n in ref if got.get(n) is None and ref[n] is not None]
    problems += [f"{n}: not in the unsplit model" for n in got if n not in ref]
    max_abs = max_rel = used = 0.0
    worst = None
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
            problems.append(f"{name}: max abs diff {diff.max().item():.3g}")
    loss_diff = abs(loss - ref_loss)
    if loss_diff > atol + rtol * abs(ref_loss):
        problems.append(f"loss {loss:.6f} vs unsplit {ref_loss:.6f}")
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
        "problems": problems[:20],
    }


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
