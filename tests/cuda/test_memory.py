"""The memory options on a GPU, through the front door: frozen models in bf16 by
default on CUDA, gradient checkpointing, the lean critics, the optimisers and the fused chunked
log-probs, each in a short ``textrl train``; and gradient checkpointing's gradients on the device.

Marked ``cuda`` and run on the ``run_device`` fixture as tests/cuda/test_front_door.py is
(``TEXTRL_CUDA_TESTS_ON=cpu pytest -m cuda tests/cuda`` rehearses them on a CPU).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.arithmetic import assert_gradients_close, model_rtol
from tests.cuda.test_front_door import SMALL, check_run, textrl

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("options", [
    ["--gradient-checkpointing", "true"],
    ["--critic", "shared"],
    ["--critic", "lora"],
    ["--optim", "adamw_bnb_8bit"],
    ["--dtype", "bfloat16", "--optim", "adamw_anyprecision"],
    ["--logprob-chunk-size", "3"],
    ["--gradient-checkpointing", "true", "--critic", "lora", "--logprob-chunk-size", "110"],
], ids=lambda o: "_".join(x.strip("-") for x in o))
def test_train_runs_with_each_memory_option(tmp_path, run_device, options):
    if "adamw_bnb_8bit" in options:
        pytest.importorskip("bitsandbytes")
    out = tmp_path / "run"
    textrl("train", "--device", run_device, "--agent", "gae_ppo", "--iterations", "2", "--output-dir", out,
           *SMALL, *options)
    check_run(out, run_device, 2)


def test_frozen_models_are_bf16_on_cuda_by_default(tmp_path, run_device):
    out = tmp_path / "run"
    textrl("train", "--device", run_device, "--agent", "gae_ppo", "--iterations", "1", "--output-dir", out, *SMALL)
    precision = json.loads((out / "summary.json").read_text())["precision"]
    assert precision["frozen_dtype"] == ("bfloat16" if run_device == "cuda" else "float32")
    assert precision["dtype"] == "float32"


def test_gradient_checkpointing_gives_the_same_gradients_on_the_device(run_device):
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
    from textrl.models.checkpointing import enable_gradient_checkpointing

    tok = build_tiny_tokenizer()
    plain = build_tiny_causal_lm(tok).to(run_device).eval()
    checkpointed = copy.deepcopy(plain)
    enable_gradient_checkpointing(checkpointed, "policy")
    ids = torch.randint(3, len(tok), (4, 40), device=run_device)
    grads = []
    for model in (plain, checkpointed):
        model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    # the recompute runs the same kernels, but CUDA's attention and embedding backwards may add in
    # another order from run to run: equal by norm (tests/arithmetic.py; an element that cancels to
    # ~0 differs by float noise far above itself)
    assert_gradients_close(grads[1], grads[0], model_rtol(plain.config, ids.numel()))


def test_gradient_checkpointing_holds_less_from_the_first_forward_with_gradients():
    """The first forward with gradients after one without (an update's first micro-batch after the
    rollout's forwards) is checkpointed: the backward's peak is well under the plain model's. On the
    H200's transformers 5.17 it was not (the layers' flags came one call late)."""
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
    from textrl.models.checkpointing import enable_gradient_checkpointing

    tok = build_tiny_tokenizer()
    plain = build_tiny_causal_lm(tok, hidden_size=256, intermediate_size=1024, num_hidden_layers=8).to("cuda").eval()
    checkpointed = copy.deepcopy(plain)
    enable_gradient_checkpointing(checkpointed, "policy")
    ids = torch.randint(3, len(tok), (16, 384), device="cuda")
    peaks = []
    for model in (plain, checkpointed):
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)  # the rollout's forward
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        model.zero_grad(set_to_none=True)
    assert peaks[1] < 0.6 * peaks[0], f"peak above the weights: plain {peaks[0] / 2**20:.0f} MiB, checkpointed {peaks[1] / 2**20:.0f} MiB"
