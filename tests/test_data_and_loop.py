"""Datasets, the LR schedule and the verify comparison: the pieces of the loop that need no ranks."""

from __future__ import annotations

import math

import pytest
import torch

from runner.data import SyntheticData, TextData
from runner.errors import ConfigError
from runner.train import lr_factor
from runner.verify import compare


def test_synthetic_batches_are_a_pure_function_of_seed_and_step():
    a, b = SyntheticData(vocab_size=32, signal=0.9, seed=0), SyntheticData(vocab_size=32, signal=0.9, seed=0)
    x, y = a.batch(3, 8, 16)
    x2, y2 = b.batch(3, 8, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, a.batch(4, 8, 16)[0])
    assert not torch.equal(x, SyntheticData(vocab_size=32, signal=0.9, seed=1).batch(3, 8, 16)[0])
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens


def test_synthetic_data_follows_its_rule_at_the_signal_rate():
    data = SyntheticData(vocab_size=64, signal=0.9, seed=0)
    x, y = data.batch(0, 256, 32)
    follows = (data.rule[x] == y).float().mean().item()
    assert 0.88 < follows < 0.93  # 0.9 + 0.1/64 by chance: a model can learn most of it


def test_text_data_reads_byte_windows_of_the_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(200)))
    x, y = TextData(path=str(path), vocab_size=256, seed=0).batch(0, 4, 10)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(x[:, 1] - x[:, 0], torch.ones(4, dtype=torch.long))  # contiguous bytes
    path.write_bytes(b"tiny")
    with pytest.raises(ConfigError, match="train.seq_len"):
        TextData(path=str(path), vocab_size=256, seed=0).batch(0, 4, 10)


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    f = [lr_factor(s, steps=20, warmup_steps=4, min_lr_ratio=0.1) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert math.isclose(f[-1], 0.1)


def test_verify_comparison_catches_scaled_and_missing_gradients():
    ref = {"a": torch.randn(10), "b": torch.randn(3)}
    same = compare({k: v.clone() for k, v in ref.items()}, ref, 1.0, 1.0)
    assert same["passed"] and same["max_abs_diff"] == 0
    scaled = compare({"a": ref["a"] * 0.5, "b": ref["b"]}, ref, 1.0, 1.0)
    assert not scaled["passed"] and scaled["worst_param"] == "a"
    assert scaled["max_rel_diff"] == pytest.approx(0.5)
    missing = compare({"a": ref["a"], "b": None}, ref, 1.0, 1.0)
    assert not missing["passed"] and "b: no gradient" in missing["problems"][0]
    assert not compare(ref, ref, 1.0, 1.01)["passed"]  # the loss is compared too
