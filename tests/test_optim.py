"""``--optim``: AnyPrecisionAdamW against torch's AdamW (float32) and a float32 reference (bf16),
bitsandbytes' 8-bit AdamW, and the refusals of optimisers that would lose bf16 updates."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.config import TrainConfig
from textrl.core.optim import AnyPrecisionAdamW, check_optim, make_optimizer


def _steps(optimizer_cls, params, grads, **kwargs):
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = optimizer_cls(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step()
    return params, opt


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), lr=st.sampled_from([1e-4, 3e-3, 0.1]), wd=st.sampled_from([0.0, 0.01]),
       steps=st.integers(1, 6), beta2=st.sampled_from([0.95, 0.999]))
def test_anyprecision_equals_torch_adamw_on_float32_weights(seed, lr, wd, steps, beta2):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(7, 5, generator=gen), torch.randn(3, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]
    kw = dict(lr=lr, weight_decay=wd, betas=(0.9, beta2), eps=1e-8)
    ours, opt = _steps(AnyPrecisionAdamW, params, grads, **kw)
    theirs, _ = _steps(torch.optim.AdamW, params, grads, foreach=False, **kw)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    state = opt.state[ours[0]]
    assert state["exp_avg"].dtype == torch.float32 and "compensation" not in state


def test_anyprecision_keeps_the_bf16_updates_torch_adamw_rounds_away():
    """200 steps of lr 1e-4 on weights of size ~1: each step is far below bf16's resolution (1/128
    near 1), so torch's AdamW on bf16 weights does not move them at all; the Kahan-summed weights
    follow the float32 run to within a rounding or two."""
    gen = torch.Generator().manual_seed(0)
    start = (1 + torch.rand(256, generator=gen)).bfloat16().float()  # the same start in both dtypes
    sign = torch.randn(256, generator=gen).sign()  # each weight pushed one way: it drifts by ~lr a step
    grads = [[sign * (1 + torch.rand(256, generator=gen))] for _ in range(200)]
    kw = dict(lr=1e-4, weight_decay=0.0)
    (fp32,), _ = _steps(torch.optim.AdamW, [start], grads, foreach=False, **kw)
    (naive,), _ = _steps(torch.optim.AdamW, [start.bfloat16()], grads, foreach=False, **kw)
    (kahan,), opt = _steps(AnyPrecisionAdamW, [start.bfloat16()], grads, **kw)
    moved = (fp32.detach() - start).abs()
    assert float(moved.mean()) > 2e-3  # the float32 run moves
    assert torch.equal(naive, start.bfloat16())  # every update lost
    # the Kahan-summed weights are the float32 run rounded to bf16 (within one bf16 step, 2^-7 below 2),
    # and weights + compensation follow it far closer than the run moved
    assert float((kahan.float() - fp32).abs().max()) <= 2**-7
    compensated = kahan.float() + opt.state[kahan]["compensation"].float()
    assert float((compensated - fp32).abs().max()) < 0.1 * float(moved.mean())
    assert opt.state[kahan]["compensation"].dtype == torch.bfloat16


def test_anyprecision_state_dict_round_trips_and_resumes_the_same():
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(4, 4, generator=gen).bfloat16()]
    grads = [[torch.randn(4, 4, generator=gen)] for _ in range(4)]
    whole, _ = _steps(AnyPrecisionAdamW, params, grads, lr=1e-2)
    half, opt = _steps(AnyPrecisionAdamW, params, grads[:2], lr=1e-2)
    resumed = [torch.nn.Parameter(half[0].detach().clone())]
    opt2 = AnyPrecisionAdamW(resumed, lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for (g,) in grads[2:]:
        resumed[0].grad = g.bfloat16()
        opt2.step()
    assert torch.equal(resumed[0], whole[0])


def test_make_optimizer_builds_each_choice():
    p = torch.nn.Parameter(torch.randn(64, 64))
    assert isinstance(make_optimizer("adamw_torch", [{"params": [p], "lr": 1e-3}]), torch.optim.AdamW)
    assert isinstance(make_optimizer("adamw_anyprecision", [{"params": [p], "lr": 1e-3}]), AnyPrecisionAdamW)
    pytest.importorskip("bitsandbytes")
    opt = make_optimizer("adamw_bnb_8bit", [{"params": [p], "lr": 1e-3}])
    before = p.detach().clone()
    p.grad = torch.randn(64, 64)
    opt.step()
    assert not torch.equal(p, before) and opt.state[p]["state1"].dtype == torch.uint8  # 8-bit moments


def test_bf16_weights_with_an_optimiser_that_loses_updates_are_refused_naming_both():
    for optim in ("adamw_torch", "adamw_bnb_8bit"):
        with pytest.raises(ValueError, match=rf"dtype='bfloat16' with optim='{optim}'.*--optim adamw_anyprecision"):
            TrainConfig(agent="gae_ppo", dtype="bfloat16", optim=optim).validate()
    TrainConfig(agent="gae_ppo", dtype="bfloat16", optim="adamw_anyprecision").validate()
    # a LoRA policy trains float32 adapters on the bf16 base: torch's AdamW keeps their updates
    TrainConfig(agent="grpo", dtype="bfloat16", lora_r=4).validate()
    with pytest.raises(ValueError, match="optim='adam': must be one of adamw_torch, adamw_bnb_8bit"):
        TrainConfig(optim="adam").validate()
    with pytest.raises(ValueError, match="use adamw_bnb_8bit"):
        check_optim("paged_adamw_8bit", "float32")


def test_a_non_default_optimiser_is_refused_with_sharding():
    with pytest.raises(ValueError, match="optim='adamw_anyprecision' with fsdp=True"):
        TrainConfig(agent="gae_ppo", optim="adamw_anyprecision", fsdp=True).validate()
