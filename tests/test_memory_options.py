"""The memory options on the CPU: gradient checkpointing (same gradients, layers
recomputed), frozen models in bf16 (``frozen_dtype``), the lean critics (``critic='shared'`` /
``'lora'``), and the refusals of combinations that cannot work."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
from torch import nn

from tests.arithmetic import assert_gradients_close, model_rtol
from textrl.agents import AGENTS
from textrl.agents.build import task_reward
from textrl.config import TrainConfig
from textrl.core.precision import Precision
from textrl.models import build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer
from textrl.models.checkpointing import enable_gradient_checkpointing
from textrl.models.value import SharedTrunkValue, ValueModel
from textrl.parallel.base import param_groups
from textrl.testing import assert_close_normwise

QUIET = dict(log=lambda *a, **k: None)


def small(**overrides) -> TrainConfig:
    base = dict(agent="gae_ppo", prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=6, ppo_epochs=1,
                num_minibatches=1, warmup_sft_steps=0, eval_size=4, eval_every=0, progress=False, iterations=2)
    base.update(overrides)
    return TrainConfig(**base)


def _batch(tok, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tok), (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    return ids, mask


def _grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    kwargs = {} if isinstance(model, ValueModel) else {"use_cache": False}  # as textrl's forwards call them
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out
    (logits.float().square().mean()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- gradient checkpointing ------------------------------------------------------------------------


@pytest.mark.parametrize("build", [build_tiny_causal_lm, build_tiny_gpt2])
def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes_each_layer(build):
    tok = build_tiny_tokenizer()
    plain = build(tok).eval()
    checkpointed = copy.deepcopy(plain)
    assert enable_gradient_checkpointing(checkpointed, "policy") == plain.config.num_hidden_layers
    ids, mask = _batch(tok)
    want, got = _grads(plain, ids, mask), _grads(checkpointed, ids, mask)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    # the forward keeps each layer's input only: far fewer saved bytes than every activation
    assert _saved_bytes(checkpointed, ids, mask) < 0.5 * _saved_bytes(plain, ids, mask)
    # dropout and every submodule stay in eval mode; a forward without gradients runs as before, cache kept
    assert not checkpointed.training and not any(m.training for m in checkpointed.modules()
                                                 if not hasattr(m, "gradient_checkpointing"))
    with torch.no_grad():
        out = checkpointed(input_ids=ids, attention_mask=mask, use_cache=True)
    assert out.past_key_values is not None
    assert not any(m.training for m in checkpointed.modules())


@pytest.mark.parametrize("build", [build_tiny_causal_lm, build_tiny_gpt2])
def test_every_layer_is_checkpointed_from_the_first_forward_with_gradients_after_one_without(build, monkeypatch):
    """transformers before 5.2x decides in a layer's ``__call__``, before the layer's own forward
    hooks run, whether to checkpoint it: each layer must already be in training mode when its
    ``__call__`` starts, in the first forward with gradients after a forward without (an update's
    first micro-batch after the rollout's forwards). The decision point is recorded here for any
    installed version."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    seen: list[bool] = []
    call = GradientCheckpointingLayer.__call__

    def recording_call(self, *args, **kwargs):
        seen.append(bool(self.training and self.gradient_checkpointing))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", recording_call)
    tok = build_tiny_tokenizer()
    model = build(tok).eval()
    enable_gradient_checkpointing(model, "policy")
    ids, mask = _batch(tok)
    n = model.config.num_hidden_layers
    for grad in (False, True, True, False, True):
        seen.clear()
        with torch.set_grad_enabled(grad):
            model(input_ids=ids, attention_mask=mask, use_cache=not grad)
        assert seen == [grad] * n, f"grad={grad}: layers entered in training mode {seen}"
    # the body called on its own (a shared critic's pass, fused log-probs) too
    seen.clear()
    model.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert seen == [True] * n


def _saved_bytes(model, ids, mask):
    """Bytes the autograd graph of one forward keeps for the backward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    return total[0]


def test_a_checkpointed_layer_is_recomputed_on_the_attention_kernels_its_forward_could_use():
    """textrl's CUDA training forwards run under ``sdpa_kernel(flash, efficient, math)`` and the
    backward runs after that context closed: the recompute must not pick another kernel (the first
    H200 run: torch's CheckpointError, saved tensors of another shape). Here the forward is limited
    to the math kernel and the backward runs outside it (the CPU's default would be flash)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tok = build_tiny_tokenizer()
    plain = build_tiny_causal_lm(tok).eval()
    checkpointed = copy.deepcopy(plain)
    enable_gradient_checkpointing(checkpointed, "policy")
    ids, mask = _batch(tok, seed=2)
    grads = []
    for model in (plain, checkpointed):
        with sdpa_kernel([SDPBackend.MATH]):
            loss = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().square().mean()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_of_a_value_model_gives_the_same_gradients():
    tok = build_tiny_tokenizer()
    critic = ValueModel.from_causal_lm(build_tiny_causal_lm(tok))
    nn.init.normal_(critic.value_head.weight, std=0.1)
    checkpointed = copy.deepcopy(critic)
    enable_gradient_checkpointing(checkpointed, "critic")
    ids, mask = _batch(tok, seed=1)
    want, got = _grads(critic, ids, mask), _grads(checkpointed, ids, mask)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_of_a_model_without_it_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True: the policy \(Sequential\) has no transformers "
                                         r"layers to checkpoint; drop --gradient-checkpointing"):
        enable_gradient_checkpointing(nn.Sequential(nn.Linear(2, 2)), "policy")


def _train(tmp_path, name, **overrides):
    from textrl.training.trainer import train

    out = tmp_path / name
    with contextlib.redirect_stdout(None):
        train(small(output_dir=str(out), **overrides))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], out


@pytest.mark.slow
def test_a_run_with_gradient_checkpointing_trains_as_one_without(tmp_path):
    plain, _ = _train(tmp_path, "plain")
    checkpointed, out = _train(tmp_path, "gc", gradient_checkpointing=True)
    for a, b in zip(plain, checkpointed):
        for key in ("loss/policy", "loss/value", "grad_norm/actor", "reward/mean", "kl/collection"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert json.loads((out / "config.yaml").read_text().split("gradient_checkpointing:")[1].split("\n")[0]) is True


# -- frozen models in bf16 -------------------------------------------------------------------------


def test_frozen_dtype_auto_is_bf16_on_cuda_and_the_weights_dtype_elsewhere(monkeypatch):
    assert Precision.of(small(), "cpu").frozen == torch.float32
    assert Precision.of(small(frozen_dtype="bfloat16"), "cpu").frozen == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert Precision.of(small(), "cuda").frozen == torch.bfloat16
    assert Precision.of(small(frozen_dtype="float32"), "cuda").frozen == torch.float32
    with pytest.raises(ValueError, match="frozen_dtype='half': must be one of auto, float32, bfloat16"):
        small(frozen_dtype="half").validate()


def test_the_reference_and_the_reward_model_are_frozen_in_frozen_dtype_and_the_trained_ones_are_not():
    agent = AGENTS["gae_ppo"].from_config(small(frozen_dtype="bfloat16"), "cpu", **QUIET)
    assert {p.dtype for p in agent.ref_policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in agent.policy.parameters()} == {torch.float32}
    assert {p.dtype for p in agent.critic.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in agent.ref_policy.parameters())
    neural = task_reward(agent, "reward_model:tiny").functions["reward_model"]
    assert {p.dtype for p in neural.model.parameters()} == {torch.bfloat16}
    assert agent.precision.record()["frozen_dtype"] == "bfloat16"
    default = AGENTS["gae_ppo"].from_config(small(), "cpu", **QUIET)  # the CPU default: unchanged
    assert {p.dtype for p in default.ref_policy.parameters()} == {torch.float32}


def test_a_frozen_copy_shares_no_storage_keeps_ties_and_the_logits():
    tok = build_tiny_tokenizer()
    model = build_tiny_gpt2(tok).eval()  # tied input / output embeddings
    same = Precision(torch.device("cpu")).frozen_copy(model)
    half = Precision(torch.device("cpu"), frozen_dtype=torch.bfloat16).frozen_copy(model)
    ptrs = {p.data_ptr() for p in model.parameters()}
    for copy_ in (same, half):
        assert not ptrs & {p.data_ptr() for p in copy_.parameters()}
        assert copy_.get_output_embeddings().weight is copy_.get_input_embeddings().weight
    ids, mask = _batch(tok)
    with torch.no_grad():
        torch.testing.assert_close(same(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)
        diff = half(input_ids=ids, attention_mask=mask).logits.float() - model(input_ids=ids, attention_mask=mask).logits
    assert float(diff.abs().max()) < 0.1  # bf16 weights: close, not equal


# -- the lean critics ------------------------------------------------------------------------------


def test_a_shared_critic_is_a_value_head_on_the_policy_body_whose_loss_reaches_that_body():
    agent = AGENTS["gae_ppo"].from_config(small(critic="shared"), "cpu", **QUIET)
    assert isinstance(agent.critic, SharedTrunkValue)
    assert [n for n, _ in agent.critic.named_parameters()] == ["value_head.weight", "value_head.bias"]
    assert agent.critic.backbone is agent.policy.model
    actor, critic = (g["params"] for g in param_groups(agent))
    assert not {id(p) for p in actor} & {id(p) for p in critic}
    nn.init.normal_(agent.critic.value_head.weight, std=0.1)
    ids, mask = _batch(agent.tokenizer)
    agent.critic(ids, mask).square().mean().backward()
    trunk = agent.policy.model.layers[0].mlp.down_proj.weight
    assert trunk.grad is not None and bool(trunk.grad.abs().sum() > 0)
    assert set(agent.critic.state_dict()) == {"value_head.weight", "value_head.bias"}


def test_a_lora_critic_trains_an_adapter_and_a_head_on_a_frozen_copy_of_the_body():
    agent = AGENTS["gae_ppo"].from_config(small(critic="lora", frozen_dtype="bfloat16"), "cpu", **QUIET)
    trained = {n for n, p in agent.critic.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or n.startswith("value_head") for n in trained)
    assert {p.dtype for n, p in agent.critic.named_parameters() if n not in trained} == {torch.bfloat16}
    assert {p.dtype for n, p in agent.critic.named_parameters() if n in trained} == {torch.float32}
    policy_ptrs = {p.data_ptr() for p in agent.policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in agent.critic.parameters()}
    values = agent.critic(*_batch(agent.tokenizer))
    assert values.dtype == torch.float32 and bool((values == 0).all())  # a zero head: V = 0 at the start


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["shared", "lora"])
def test_a_run_with_a_lean_critic_trains_and_resumes(tmp_path, critic):
    rows, out = _train(tmp_path, critic, critic=critic, checkpoint_every=1, reward="missing_eos_penalty")
    assert len(rows) == 2 and all(r["nonfinite/skipped_updates"] == 0 for r in rows)
    assert rows[-1]["loss/value"] > 0
    from textrl.training.trainer import train

    with contextlib.redirect_stdout(None):
        train(small(output_dir=str(out), critic=critic, iterations=3, resume=True, reward="missing_eos_penalty"))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("overrides, says", [
    (dict(agent="grpo", critic="shared"), "grpo does not read critic='shared' (it has no critic)"),
    (dict(agent="gae_ppo", critic="lora", lora_r=4), "critic='lora': with a LoRA policy (gae_ppo, lora_r=4) the critic "
                                                     "is set by --critic-type"),
    (dict(agent="gae_ppo", critic="shared", critic_init="reward_model", reward_model="tiny"),
     "critic='shared' with critic_init='reward_model'"),
    (dict(agent="gae_ppo", critic="shared", fsdp=True), "critic='shared' with fsdp=True"),
    (dict(agent="gae_ppo", critic="value"), "critic='value': must be one of separate, shared, lora"),
    (dict(logprob_chunk_size=-1), "logprob_chunk_size=-1: must be a whole number of positions >= 0"),
])
def test_option_combinations_that_cannot_work_are_refused_in_one_line(overrides, says):
    with pytest.raises(ValueError, match=None) as err:
        small(**overrides).validate()
    assert says in str(err.value) and "\n" not in str(err.value)


# -- fused, chunked log-probs in the agents ----------------------------------------------------------


@pytest.mark.parametrize("sampling", [dict(), dict(top_k=7, temperature=0.7), dict(top_p=0.9, entropy_coef=0.01)])
def test_an_agent_with_fused_logprobs_computes_the_whole_logits_paths_values_and_gradients(sampling):
    fused = AGENTS["gae_ppo"].from_config(small(logprob_chunk_size=5, **sampling), "cpu", **QUIET)
    whole = AGENTS["gae_ppo"].from_config(small(logprob_chunk_size=0, **sampling), "cpu", **QUIET)
    ids, mask = _batch(fused.tokenizer, seed=3)
    mask[0, :4], mask[0, 4:] = 0, 1  # row 0: a left-padded prompt
    prompt, action = 6, ids[:, 6:]
    results = []
    for agent in (fused, whole):
        agent.policy.zero_grad(set_to_none=True)
        logp, entropy = agent.learner.forwards.logprobs_and_entropy(agent.policy, ids, mask, prompt, action)
        (logp.sum() + entropy.sum()).backward()
        with torch.no_grad():
            ref = agent.learner.forwards.logprobs(agent.ref_policy, ids, mask, prompt, action)
        results.append((logp.detach(), entropy.detach(), ref, {n: p.grad for n, p in agent.policy.named_parameters()}))
    (a_lp, a_ent, a_ref, a_grad), (b_lp, b_ent, b_ref, b_grad) = results
    # the chunked head sums the vocabulary (a log-sum-exp against a log-softmax kernel) and the
    # positions in another order: the log-probs, the entropies and each gradient equal by norm
    # (tests/arithmetic.py; a gradient element that cancels to ~0 differs by float noise far above it)
    rtol = model_rtol(fused.policy.config, ids.numel())
    for name, got, want in (("logp", a_lp, b_lp), ("entropy", a_ent, b_ent), ("ref logp", a_ref, b_ref)):
        finite = torch.isfinite(want)  # tokens a top-k / top-p filter drops: -inf in both
        assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], want[~finite]), name
        assert_close_normwise(got[finite], want[finite], rtol=rtol, name=name)
    for name, want in b_grad.items():
        if want is None:
            assert a_grad[name] is None or not bool(a_grad[name].any()), name
    assert_gradients_close({n: g for n, g in a_grad.items() if b_grad[n] is not None},
                           {n: g for n, g in b_grad.items() if g is not None}, rtol)


def test_an_asked_for_fused_path_on_a_head_that_cannot_fuse_warns_once_and_uses_the_logits(monkeypatch):
    from textrl.models import forward as model_forward

    agent = AGENTS["gae_ppo"].from_config(small(logprob_chunk_size=5), "cpu", **QUIET)
    monkeypatch.setattr(model_forward, "unfusable_reason", lambda model: "a test's reason")
    ids, mask = _batch(agent.tokenizer)
    mask[:] = 1
    with pytest.warns(UserWarning, match="logprob_chunk_size=5: response_hidden: .*a test's reason; this run's "
                                         "log-probs use the whole response's logits"):
        agent.learner.forwards.logprobs(agent.policy, ids, mask, 6, ids[:, 6:])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agent.learner.forwards.logprobs(agent.policy, ids, mask, 6, ids[:, 6:])  # once
    assert AGENTS["gae_ppo"].from_config(small(), "cpu", **QUIET).learner.forwards.fused_chunk() == 0  # auto: off on the CPU
