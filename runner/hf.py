"""Shim (relayout: keep-file): Hugging Face families moved to ``runner.models.hf`` (issue #34); an
older run's ``model._target_: runner.hf.causal_lm`` still resolves here."""

from runner.models.hf import causal_lm

__all__ = ["causal_lm"]
