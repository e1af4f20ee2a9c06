"""``verify``'s comparisons: the run's numbers against the unsplit reference's, tensors and floats
in, a report out (``passed``, the largest differences, the problems by name). Nothing here runs a
model or a collective (``runner.verify`` does), so each rule is tested in-process.

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
# the fraction of a tensor's elements that may be further off). A double or skipped update moves
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
    with ``rtol``/``atol`` on the loss and on every gradient, and no gradient missing."""
    problems = [f"{n}: no gradient in the pipeline" for n in ref if got.get(n) is None and ref[n] is not None]
    problems += [f"{n}: not in the unsplit model" for n in got if n not in ref]
    max_abs = max_rel = 0.0
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
        "worst_param": worst,
        "rtol": rtol,
        "atol": atol,
        "problems": problems[:20],
    }


def compare_weights(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor], lr: float, *,
                    max_lr_units: float = WEIGHT_TOLERANCES["fp32"][0],
                    max_fraction: float = WEIGHT_TOLERANCES["fp32"][1]) -> dict:
    """The weights after an update, in units of its learning rate ``lr``: a tensor fails when
    more than ``max_fraction`` of its elements differ from the unsplit model's by more than
    ``max_lr_units`` x lr. Reports the largest difference (in lr) and the largest fraction off."""
    problems = [f"{n}: not in the unsplit model" for n in got if n not in ref]
    worst_units, worst_fraction, worst = 0.0, 0.0, None
    for name, w in got.items():
        if w is None or name not in ref:
            continue
        units = (w - ref[name]).abs() / max(lr, 1e-30)  # lr 0: any difference fails
        fraction = (units > max_lr_units).float().mean().item()
        if units.max().item() > worst_units:
            worst_units, worst = units.max().item(), name
        worst_fraction = max(worst_fraction, fraction)
        if fraction > max_fraction:
            problems.append(f"{name}: {fraction:.1%} of its elements differ by more than {max_lr_units:g} lr "
                            f"(lr {lr:.3g}; at most {units.max().item():.3g} lr)")
    return {"passed": not problems, "lr": lr, "max_lr_units": worst_units, "max_fraction_off": worst_fraction,
            "worst_param": worst, "max_lr_units_allowed": max_lr_units, "max_fraction_allowed": max_fraction,
            "problems": problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])}


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
