"""Datasets, the optimizer's groups and LR schedules, and verify's comparisons: the pieces of the
loop that need no ranks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from runner.data.datasets import SyntheticData, TextData, build_dataset, get_batch
from runner.errors import ConfigError
from runner.losses import TargetWeighted, cross_entropy
from runner.models.builtin import transformer
from runner.models.split import build_meta_model
from runner.optim import build_optimizer, lr_factor, param_groups
from runner.verify.compare import ROUNDING_FACTOR, Exact, compare, compare_drift, compare_weights


def test_synthetic_batches_are_a_pure_function_of_seed_and_step():
    a, b = SyntheticData(vocab_size=32, signal=0.9, seed=0), SyntheticData(vocab_size=32, signal=0.9, seed=0)
    x, y = a.batch(3, 8, 16)
    x2, y2 = b.batch(3, 8, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, a.batch(4, 8, 16)[0])
    assert not torch.equal(x, SyntheticData(vocab_size=32, signal=0.9, seed=1).batch(3, 8, 16)[0])
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens


def test_each_replica_takes_its_rows_of_the_batch_contiguous():
    from runner.train import _replica_share

    x, y = SyntheticData(vocab_size=32, signal=0.9, seed=0).batch(1, 8, 16)
    mask = torch.ones(16, 8, dtype=torch.bool).t()  # a transposed view
    assert not x.is_contiguous() and not mask.is_contiguous()  # views: of the (batch, seq + 1) window, transposed
    inputs, targets, kwargs = _replica_share((x, y, {"attention_mask": mask}), SimpleNamespace(dp=2, dp_rank=1),
                                             torch.device("cpu"))
    assert torch.equal(inputs, x[4:]) and torch.equal(targets, y[4:]) and kwargs["attention_mask"].shape == (4, 16)
    assert all(t.is_contiguous() for t in (inputs, targets, kwargs["attention_mask"]))


def test_held_out_batches_never_repeat_training_batches():
    data = SyntheticData(vocab_size=32, signal=0.9, seed=0)
    train = {tuple(data.batch(s, 4, 8)[0].flatten().tolist()) for s in range(1, 51)}
    val = {tuple(data.batch(s, 4, 8, split="val")[0].flatten().tolist()) for s in range(1, 51)}
    assert not train & val
    assert torch.equal(data.batch(2, 4, 8, split="val")[0], data.batch(2, 4, 8, split="val")[0])


def test_padded_synthetic_batches_mask_the_pad_and_ignore_its_targets():
    inputs, targets, kwargs = get_batch(SyntheticData(vocab_size=32, signal=0.9, seed=0, padding=True), 1, 64, 16)
    mask = kwargs["attention_mask"]
    assert mask.shape == (64, 16) and mask.dtype == torch.bool
    pad = (~mask).sum(1)
    assert pad.min() == 0 and pad.max() == 8 and (pad > 0).float().mean() > 0.5  # 0..seq/2, left
    assert torch.equal(mask, torch.arange(16) >= pad[:, None])
    assert torch.equal(targets == -100, ~mask) and (inputs[~mask] == 0).all()


def _microbatch_mean(loss_fn, logits: torch.Tensor, targets: torch.Tensor, parts: int) -> torch.Tensor:
    """What the schedules make of a loss over ``parts`` microbatches: the mean of its values."""
    return torch.stack([loss_fn(x, y) for x, y in zip(logits.tensor_split(parts), targets.tensor_split(parts))]).mean()


def test_weighted_microbatch_losses_average_to_the_whole_batchs_mean_over_its_counted_targets():
    # Padding falls unevenly between microbatches: a plain mean of their means weights a target of
    # a short microbatch more than the unsplit model's mean over the batch does. Weighted by their
    # counted targets, the means average to the whole batch's loss, and its gradient.
    torch.manual_seed(0)
    _, targets, _ = get_batch(SyntheticData(vocab_size=32, signal=0.9, seed=0, padding=True), 1, 8, 16)
    logits = torch.randn(8, 16, 32, requires_grad=True)
    counts = (targets != -100).sum(1)
    assert len(set(counts.tolist())) > 3  # uneven: the test means something
    whole = cross_entropy(logits, targets)
    (whole_grad,) = torch.autograd.grad(whole, logits)
    plain = _microbatch_mean(cross_entropy, logits, targets, 8)
    (plain_grad,) = torch.autograd.grad(plain, logits)
    assert abs(plain.item() - whole.item()) > 5e-4  # the mean of means is another number, with other gradients
    assert (plain_grad - whole_grad).abs().max() > 1e-4
    weighted = TargetWeighted(cross_entropy)
    weighted.weigh(counted=int(counts.sum()), total=targets.numel(), parts=8)
    loss = _microbatch_mean(weighted, logits, targets, 8)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-8)
    # Two replicas of 4 microbatches each, weighed by the global count: their mean is the whole batch's too.
    halves = [_microbatch_mean(weighted, logits[rows], targets[rows], 4) for rows in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(torch.stack(halves).mean(), whole, rtol=1e-6, atol=0)


def test_weighted_losses_are_bit_identical_without_padding_and_a_microbatch_of_padding_adds_nothing():
    torch.manual_seed(0)
    logits, targets = torch.randn(4, 16, 32, requires_grad=True), torch.randint(32, (4, 16))
    weighted = TargetWeighted(cross_entropy)
    weighted.weigh(counted=64, total=64, parts=4)
    for x, y in zip(logits.tensor_split(4), targets.tensor_split(4)):  # every scale exactly 1.0
        assert torch.equal(weighted(x, y), cross_entropy(x, y))
    # Nothing ignored: the loss's own tensor, nothing counted or scaled on the device in the step.
    means = []
    unweighed = TargetWeighted(lambda x, y: means.append(cross_entropy(x, y)) or means[-1])
    unweighed.weigh(counted=64, total=64, parts=4)
    assert all(unweighed(x, y) is means[-1] for x, y in zip(logits.tensor_split(4), targets.tensor_split(4)))
    # A microbatch whose targets are all ignored: its own mean is 0/0; it adds 0, and no NaN gradient.
    targets[0] = -100
    weighted.weigh(counted=48, total=64, parts=4)
    loss = _microbatch_mean(weighted, logits, targets, 4)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, cross_entropy(logits, targets), rtol=1e-6, atol=0)
    assert torch.isfinite(grad).all() and not grad[0].any()


def test_synthetic_data_follows_its_rule_at_the_signal_rate():
    data = SyntheticData(vocab_size=64, signal=0.9, seed=0)
    x, y = data.batch(1, 256, 32)
    follows = (data.rule[x] == y).float().mean().item()
    assert 0.88 < follows < 0.93  # 0.9 + 0.1/64 by chance: a model can learn most of it


def test_text_data_reads_byte_windows_of_the_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(200)))
    data = TextData(path=str(path), vocab_size=256, seed=0, val_fraction=0.25)
    x, y = data.batch(1, 4, 10)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(x[:, 1] - x[:, 0], torch.ones(4, dtype=torch.long))  # contiguous bytes
    assert y.max() < 150 and data.batch(1, 4, 10, split="val")[0].min() >= 150  # the last quarter is held out
    path.write_bytes(b"tiny")
    with pytest.raises(ConfigError, match="train.seq_len"):
        TextData(path=str(path), vocab_size=256, seed=0).batch(1, 4, 10)


def test_lr_warms_up_linearly_then_follows_the_chosen_schedule_to_the_floor():
    curves = {name: [lr_factor(s, steps=20, warmup_steps=4, min_lr_ratio=0.1, schedule=name) for s in range(20)]
              for name in ("cosine", "linear", "constant")}
    for f in curves.values():
        assert f[:4] == [0.25, 0.5, 0.75, 1.0]
        assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert math.isclose(curves["cosine"][-1], 0.1) and math.isclose(curves["linear"][-1], 0.1)
    assert curves["constant"][4:] == [1.0] * 16
    linear_steps = [a - b for a, b in zip(curves["linear"][4:], curves["linear"][5:])]
    assert max(linear_steps) == pytest.approx(min(linear_steps)) == pytest.approx(0.9 / 15)
    cosine = curves["cosine"][4:]  # symmetric about the midpoint 0.55, above linear before it
    assert all(a + b == pytest.approx(1.1) for a, b in zip(cosine, cosine[::-1]))
    assert all(c > lin for c, lin in zip(cosine[1:7], curves["linear"][5:11]))


def test_weight_decay_skips_biases_norms_and_embeddings_by_default():
    model = transformer(vocab_size=16, max_seq_len=8, dim=8, n_layers=2, n_heads=2, ffn_mult=2, tie_embeddings=True)
    name_of = {id(p): n for n, p in model.named_parameters()}
    decayed, exempt = ({name_of[id(p)] for p in g["params"]} for g in param_groups([model], 0.1, ["bias", "norm",
                                                                                                  "embedding"]))
    assert decayed == {n for n in name_of.values() if n.endswith(("qkv.weight", "proj.weight", "up.weight",
                                                                 "down.weight"))}
    assert {"embed.tok.weight", "embed.pos.weight", "norm.weight", "norm.bias", "block0.attn.qkv.bias",
            "block1.ffn_norm.weight"} <= exempt  # the tied head weight is the embedding's: exempt, once
    assert len(decayed) + len(exempt) == len(name_of)
    everything, none = param_groups([model], 0.1, [])
    assert len(everything["params"]) == len(name_of) and not none["params"]


def test_the_optimizer_refuses_two_parameters_over_one_memory(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from runner.ranks.dist import cleanup

    train = SimpleNamespace(weight_decay=0.1, no_decay=["bias"], lr=1e-3, betas=[0.9, 0.95], steps=4,
                            warmup_steps=0, min_lr_ratio=0.1, lr_schedule="cosine")
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    build_optimizer([a, b], train)  # distinct weights, and views of one buffer that do not overlap:
    flat = torch.zeros(32)
    a.weight, b.weight = torch.nn.Parameter(flat[:16].view(4, 4)), torch.nn.Parameter(flat[16:].view(4, 4))
    build_optimizer([a, b], train)
    b.weight = torch.nn.Parameter(a.weight.data)  # a second wrapper over the first's memory
    with pytest.raises(RuntimeError, match=r"holds (0|1)\.weight and (0|1)\.weight|over the same memory"):
        build_optimizer([a, b], train)
    # A DTensor parameter has no storage of its own: two wrappers of one (the pretrained tied weight
    # under tp, wrapped by both stages' styles) are found through their local tensors.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        weight = distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        a.weight, b.weight = torch.nn.Parameter(weight), torch.nn.Parameter(torch.randn(4, 4))
        build_optimizer([a, b], train)
        b.weight = torch.nn.Parameter(weight)
        with pytest.raises(RuntimeError, match="over the same memory"):
            build_optimizer([a, b], train)
    finally:
        cleanup()


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
    assert same["tolerance_used"] == 0 and scaled["tolerance_used"] > 1


def test_verify_reports_the_share_of_the_tolerance_used_which_a_near_zero_gradient_does_not_inflate():
    ref = {"w": torch.tensor([1.0, 1e-9])}  # a gradient element at rounding level: its relative difference is huge
    report = compare({"w": torch.tensor([1.0 + 5e-6, 3e-8])}, ref, 1.0, 1.0)
    assert report["passed"] and report["max_rel_diff"] > 20  # the console printed such a run as "max rel 41"
    # 5e-6 (in fp32) of the first element's 1e-5 + 4e-5: a tenth of its tolerance; 2.9e-8 of the second's 4e-5.
    assert report["tolerance_used"] == pytest.approx(5e-6 / (4e-5 + 1e-5 * 1.0), rel=1e-2)


def _cancelling_sums() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gradient summed from terms far larger than itself (as Qwen2's value bias at a zero pad
    embedding, amplified by RMSNorm's 1/sqrt(eps)): 1000 terms of ~1e4 per element whose sum is
    ~1. Returns its float64 sum, the fp32 sum in one order (the unsplit model's), in another (two
    partial sums of the reversed terms: another layout's), and the fp32 sums of the two halves
    (two microbatches' contributions)."""
    torch.manual_seed(0)
    terms = torch.randn(1000, 64, dtype=torch.float64) * 1e4
    terms += (torch.randn(64, dtype=torch.float64) - terms.sum(0)) / 1000
    fp32 = terms.float()
    return terms.sum(0), fp32.sum(0), fp32.flip(0).reshape(2, 500, 64).sum(1).sum(0), fp32.reshape(2, 500, 64).sum(1)


def test_verify_admits_another_order_of_the_same_sums_within_ten_times_the_unsplit_models_own_rounding():
    exact, ref, other, _ = _cancelling_sums()
    strict = compare({"g": other}, {"g": ref}, 1.0, 1.0)
    assert not strict["passed"] and strict["rounding"] is None  # no float64 rerun given: the strict verdict

    def rerun():
        calls.append(1)
        return Exact(loss=1.0, grads={"g": exact})

    calls: list[int] = []
    report = compare({"g": other}, {"g": ref}, 1.0, 1.0, exact=rerun)
    numbers = report["rounding"]["admitted"]["g"]
    assert report["passed"] and calls == [1] and report["max_abs_diff"] > 10 * 4e-5  # beyond the strict tolerance
    assert numbers["unsplit_off"] == pytest.approx((ref.double() - exact).abs().max().item())
    assert numbers["run_off"] < 2 * numbers["unsplit_off"]  # the same scale: each is one order's rounding
    assert report["rounding"]["factor"] == ROUNDING_FACTOR == 10
    compare({"g": ref}, {"g": ref}, 1.0, 1.0, exact=rerun)
    assert calls == [1]  # a run that passes strictly pays nothing


def test_verify_still_fails_a_small_defect_beyond_the_rounding_of_the_computation():
    exact, ref, _, halves = _cancelling_sums()
    rerun = lambda: Exact(loss=1.0, grads={"g": exact})  # noqa: E731
    # One of two microbatches' contributions scaled by 1.001: 1e-3 of a partial sum of ~2e5.
    scaled = compare({"g": halves[0] * 1.001 + halves[1]}, {"g": ref}, 1.0, 1.0, exact=rerun)
    beyond = scaled["rounding"]["beyond"]["g"]
    assert not scaled["passed"] and beyond["run_off"] > 100 * ROUNDING_FACTOR * beyond["unsplit_off"]
    assert scaled["problems"][0].startswith("g: max abs diff") and "the unsplit model's own fp32 rounding" in \
        scaled["problems"][0]
    # One element off float64 by 12 x the tensor's noise fails; by 8 x, it is admitted.
    noise = (ref.double() - exact).abs().max().item()
    for times, passes in ((12, False), (8, True)):
        got = ref.clone()
        got[5] = exact[5] + times * noise
        assert compare({"g": got}, {"g": ref}, 1.0, 1.0, exact=rerun)["passed"] is passes, times


def test_verify_keeps_the_strict_verdict_where_the_float64_rerun_cannot_tell():
    exact, ref, other, _ = _cancelling_sums()
    refused = compare({"g": other}, {"g": ref}, 1.0, 1.0, exact=lambda: "not run: out of memory")
    assert not refused["passed"] and refused["rounding"]["float64"] == "not run: out of memory"
    # A rerun whose loss is not the reference's (another dropout mask, another batch) is no measure of rounding.
    other_loss = compare({"g": other}, {"g": ref}, 1.0, 1.0, exact=lambda: Exact(loss=1.01, grads={"g": exact}))
    assert not other_loss["passed"] and other_loss["rounding"]["float64"].startswith("not used: its loss 1.01 ")
    # The loss itself: admitted within rounding of float64, or not.
    loss = compare({"g": ref}, {"g": ref}, 1.0 + 8e-5, 1.0, exact=lambda: Exact(loss=1.0 + 1e-5, grads={}))
    assert loss["passed"] and "(loss)" in loss["rounding"]["admitted"]
    far = compare({"g": ref}, {"g": ref}, 1.001, 1.0, exact=lambda: Exact(loss=1.0 + 1e-5, grads={}))
    assert not far["passed"] and far["problems"][0].startswith("loss 1.001000 vs unsplit 1.000000 (off float64")


def test_the_float64_rerun_that_would_not_fit_or_runs_out_of_memory_leaves_the_strict_verdict(monkeypatch):
    from runner.verify import exact, memory
    from runner.verify.hook import reference_model

    from helpers.config import TINY, compose

    cfg = compose(*TINY)
    model, _ = reference_model(cfg)
    batch = get_batch(build_dataset(cfg.data, seed=0), 1, 8, 16)
    monkeypatch.setattr(exact, "available_bytes", lambda: 2**20)  # 1 MiB free
    need = memory.float64_bytes(build_meta_model(cfg.model), microbatch=2, seq_len=16, kwargs={})
    assert exact.float64_step(model, cfg, batch, 4) == (
        f"not run: the float64 copy needs about {need / 2**30:.2f} GiB and rank 0's host has 0.00 GiB free")
    monkeypatch.setattr(exact, "available_bytes", lambda: None)  # unknown: it runs, and may fail to allocate

    def fails(message: str):
        def rerun(*_):
            raise RuntimeError(message)
        return rerun

    monkeypatch.setattr(exact, "_rerun", fails("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                                               "allocate memory: you tried to allocate 1099511627776 bytes."))
    assert exact.float64_step(model, cfg, batch, 4).startswith("not run: out of memory ([enforce fail")

    def cuda_oom(*_):  # torch.cuda.OutOfMemoryError is this class (torch 2.11 and 2.13)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")

    monkeypatch.setattr(exact, "_rerun", cuda_oom)
    assert exact.float64_step(model, cfg, batch, 4) == (
        "not run: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity)")
    # The rerun is rank 0's host's (so is its memory check), whatever the run's device: the reference it
    # copies is built there for a CUDA run too.
    on_cuda, _ = reference_model(compose(*TINY, "device=cuda"))
    assert {p.device.type for p in on_cuda.parameters()} == {"cpu"}
    monkeypatch.setattr(exact, "_rerun", fails("mat1 and mat2 shapes cannot be multiplied"))  # a bug: raised
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        exact.float64_step(model, cfg, batch, 4)


def _adamw(w: torch.Tensor, grads: list[torch.Tensor], lr: float) -> torch.Tensor:
    """``w`` after one AdamW update per gradient in ``grads`` (the runner's betas and decay)."""
    p = torch.nn.Parameter(w.clone())
    optimizer = torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach()


def test_verify_holds_updated_weights_to_lr_units_a_rounding_sign_flip_passes_a_double_update_fails():
    torch.manual_seed(0)
    w, g, lr = torch.randn(1000), torch.randn(1000), 1e-3
    ref = {"w": _adamw(w, [g], lr)}

    def flipped(n: int) -> torch.Tensor:  # rounding flips the sign of n gradient elements near zero
        f = g.clone()
        f[:n] = -f[:n]
        return f

    # An early Adam update is lr x sign(g): each flipped element lands 2 lr away, which fp32
    # gradient tolerances would call a failure; 0.5% of the elements is within the rule.
    few = _adamw(w, [flipped(5)], lr)
    assert not torch.allclose(few, ref["w"], rtol=1e-5, atol=4e-5)
    report = compare_weights({"w": few}, ref, lr)
    assert report["passed"] and report["max_lr_units"] == pytest.approx(2, rel=1e-3)
    assert report["fraction_off"] == pytest.approx(0.005)
    many = compare_weights({"w": _adamw(w, [flipped(20)], lr)}, ref, lr)  # 2%: more than 1% of the elements
    assert not many["passed"] and many["problems"][:2] == [
        "2.00% of the weights differ by more than 0.5 lr (lr 0.001; at most 1% may), most of them in:",
        "w: 2.0% of its elements (at most 2 lr)"]
    # The same update applied twice, or skipped: every element about lr away (and lr x decay x w).
    for wrong in (_adamw(w, [g, g], lr), w):
        report = compare_weights({"w": wrong}, ref, lr)
        assert not report["passed"] and report["fraction_off"] == 1.0, report
        assert 1 < report["max_lr_units"] < 1.5 and report["worst_param"] == "w"
    assert not compare_weights({"w": ref["w"], "v": w}, ref, lr)["passed"]  # a name the model does not have
    assert not compare_weights({"w": ref["w"] + 1e-9}, ref, 0.0)["passed"]  # lr 0: nothing may move


def test_verify_counts_weights_off_over_the_model_so_a_tensor_of_rounding_noise_passes():
    # A key bias's true gradient is zero; its rounding noise differs between layouts, so AdamW moves
    # about half of it 2 lr the other way (seen at pp=2 x tp=2 in bf16). A double update of the
    # other weights still fails.
    torch.manual_seed(0)
    lr, w, g = 1e-3, {"k_bias": torch.randn(32), "w": torch.randn(4000)}, {"w": torch.randn(4000)}
    g["k_bias"] = torch.randn(32) * 1e-5
    ref = {n: _adamw(w[n], [g[n]], lr) for n in w}
    noise = {"k_bias": _adamw(w["k_bias"], [torch.randn(32) * 1e-5], lr), "w": ref["w"]}
    report = compare_weights(noise, ref, lr)
    assert report["passed"] and report["worst_param"] == "k_bias" and 0.003 < report["fraction_off"] < 0.01
    twice = compare_weights({**noise, "w": _adamw(w["w"], [g["w"], g["w"]], lr)}, ref, lr)
    assert not twice["passed"] and twice["problems"][1].startswith("w: 100.0% of its elements")


def test_verify_holds_later_losses_and_gradient_norms_to_a_relative_tolerance():
    assert compare_drift(2.0, 2.0 * (1 + 5e-5), 1.0, 1.0 * (1 - 5e-5))["passed"]
    loss = compare_drift(2.0019, 2.0, 1.0, 1.0)  # the tied weight stepped twice: 1.9e-3 at step 2 (issue 33)
    assert not loss["passed"] and loss["problems"][0].startswith("loss 2.0019 vs unsplit 2")
    norm = compare_drift(2.0, 2.0, 1.25, 1.0)
    assert not norm["passed"] and norm["problems"][0].startswith("gradient norm 1.25 vs unsplit 1")
    assert norm["grad_norm_rel_diff"] == pytest.approx(0.25)
