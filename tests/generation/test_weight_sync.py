"""textrl.generation.weight_sync: buckets, packing, which weights an engine should hold (pulled from a
module or pushed), and the engines' seam (receives_weights / load_weights); the asynchronous actor
without a copy of the policy, its snapshots off the device and the bytes it holds there. Everywhere:
no vLLM (the vLLM tier checks the engines' loads themselves: tests/generation/test_vllm_receive.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.agents.async_actor import device_bytes, policy_copy, receives_directly, trainable_state
from textrl.generation import HFEngine
from textrl.generation.base import GenerationEngine
from textrl.generation.decode import DecodeEngine
from textrl.generation.static import StaticEngine
from textrl.generation.weight_sync import (
    PACK_ALIGN,
    Sent,
    WeightSync,
    bucket_counts,
    buckets,
    fingerprint,
    pack,
    unpack,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def named(sizes: list[int], dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.arange(n, dtype=torch.float32).to(dtype)) for i, n in enumerate(sizes)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=12), st.integers(1, 100))
def test_buckets_keep_the_order_stay_under_the_bound_and_agree_with_their_counts(sizes, bound):
    weights = named(sizes)  # float32: 4 bytes an element
    groups = list(buckets(iter(weights), bound))
    assert [name for group in groups for name, _ in group] == [name for name, _ in weights]
    for group in groups:
        size = sum(4 * t.numel() for _, t in group)
        assert size <= bound or len(group) == 1  # one tensor over the bound: alone
    assert [len(g) for g in groups] == bucket_counts([4 * n for n in sizes], bound)
    assert all(len(a) + len(b) > 0 for a, b in zip(groups, groups[1:], strict=False))
    for a, b in zip(groups, groups[1:], strict=False):  # no two neighbours would have fit together
        assert sum(4 * t.numel() for _, t in a + b[:1]) > bound


def test_a_bucket_of_no_bytes_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        list(buckets(named([1]), 0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6))
def test_a_packed_bucket_unpacks_to_the_same_tensors_bit_for_bit(spec):
    bucket = [(f"t{i}", (torch.randn(shape) * 100).to(dtype)) for i, (dtype, shape) in enumerate(spec)]
    flat = pack(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() % PACK_ALIGN == 0
    back = unpack(flat, [n for n, _ in bucket], [t.dtype for _, t in bucket], [list(t.shape) for _, t in bucket])
    assert fingerprint(back) == fingerprint(bucket)
    with pytest.raises(ValueError, match="holds"):
        unpack(torch.cat([flat, torch.zeros(PACK_ALIGN, dtype=torch.uint8)]), [n for n, _ in bucket],
               [t.dtype for _, t in bucket], [list(t.shape) for _, t in bucket])


def test_a_pass_fingerprints_what_went():
    weights = named([3, 4])
    sent = Sent(iter(weights))
    assert sent.fingerprint is None
    assert [n for n, _ in sent] == ["w0", "w1"]
    assert (sent.fingerprint, sent.count) == (fingerprint(weights), 2)


def test_an_engine_that_follows_a_module_is_due_when_its_weights_move_and_not_after_it_took_them():
    module = torch.nn.Linear(2, 2)
    sync = WeightSync()
    sync.follow(module, lambda m: dict(m.state_dict()))
    assert sync.due() and not sync.receiving
    sync.took(sync.wanted())
    assert not sync.due()
    with torch.no_grad():
        module.weight.add_(1.0)
    assert sync.due()
    assert [name for name, _ in sync.outgoing()] == ["weight", "bias"]
    assert sync.outgoing()[0][1].data_ptr() == module.weight.data_ptr()  # the live tensors, no copy


def test_pushed_weights_replace_the_module_for_good_and_each_push_is_due_once():
    module = torch.nn.Linear(2, 2)
    sync = WeightSync()
    sync.follow(module, lambda m: dict(m.state_dict()))
    sync.took(sync.wanted())
    snapshot = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    sync.receive(snapshot.items(), version=7)
    assert sync.receiving and sync.due()
    assert sync.outgoing()[0][1] is snapshot["weight"]  # by reference
    token = sync.wanted()
    sync.took(token)
    assert not sync.due() and sync.version == 7
    with torch.no_grad():
        module.weight.add_(1.0)  # the module is no longer read
    assert not sync.due()
    sync.receive(snapshot.items(), version=7)  # a new push, even of the same version, is handed over
    assert sync.due()


def test_the_seconds_of_the_hand_overs_are_read_once():
    sync = WeightSync()
    with sync.timed():
        pass
    first = sync.take_seconds()
    assert first >= 0.0 and sync.take_seconds() == 0.0


@pytest.mark.parametrize("engine", [HFEngine, StaticEngine, DecodeEngine])
def test_the_in_process_engines_sample_the_module_and_refuse_pushed_weights(engine):
    made = engine()
    assert made.receives_weights is False and made.take_weight_sync_seconds() == 0.0
    with pytest.raises(TypeError, match="takes no pushed weights"):
        made.load_weights([("w", torch.zeros(1))], 0)


def test_the_vllm_engines_receive_weights_without_vllm():
    from textrl.generation.vllm_engine import VLLMEngine
    from textrl.generation.vllm_server import VLLMServerEngine

    for engine in (VLLMEngine(), VLLMServerEngine()):
        assert engine.receives_weights
        engine.load_weights([("w", torch.zeros(1))], 3)  # kept for the next call, nothing started
        assert engine.sync.receiving and engine.sync.due()


# -- the asynchronous actor ------------------------------------------------------------------------------
def lora_policy():
    from peft import LoraConfig, get_peft_model

    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    return get_peft_model(build_tiny_causal_lm(build_tiny_tokenizer()), LoraConfig(r=2, target_modules=["q_proj"]))


class Receiving(GenerationEngine):
    receives_weights = True


def test_the_actor_keeps_no_copy_only_for_an_engine_that_receives_a_fully_trained_policy():
    full = torch.nn.Linear(3, 3)
    assert receives_directly(Receiving(), full)
    assert not receives_directly(HFEngine(), full)  # samples the module: needs one at the behaviour weights
    assert not receives_directly(Receiving(), lora_policy())  # the frozen base is not in the snapshots


def test_snapshots_are_copies_off_the_device_and_the_copy_holds_only_the_trained_weights():
    policy = lora_policy()
    snapshot = trainable_state(policy)
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert set(snapshot) == trained and all(t.device.type == "cpu" for t in snapshot.values())
    live = dict(policy.named_parameters())
    assert all(t.untyped_storage().data_ptr() != live[n].untyped_storage().data_ptr() for n, t in snapshot.items())
    twin = policy_copy(policy)
    total = device_bytes(policy.parameters(), "cpu")
    own = device_bytes([p for n, p in twin.named_parameters() if n in trained], "cpu")
    assert own == sum(t.numel() * t.element_size() for t in snapshot.values()) < total / 10
    assert device_bytes([*policy.parameters(), *twin.parameters()], "cpu") == total + own  # the base shared
    assert device_bytes(policy.parameters(), "meta") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: snapshots in pinned host memory")
def test_snapshots_of_cuda_weights_are_pinned_host_copies():
    policy = torch.nn.Linear(64, 64).cuda()
    snapshot = trainable_state(policy)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in snapshot.values())
    assert torch.equal(snapshot["weight"].cuda(), policy.weight)
    assert device_bytes(snapshot.values(), "cuda") == 0


@pytest.mark.parametrize("options, message", [
    (dict(weight_sync_bucket_mb=0, generation_engine="vllm"), "weight_sync_bucket_mb=0: must be a number >= 1"),
    (dict(weight_sync_bucket_mb=64, generation_engine="textrl"),
     "weight_sync_bucket_mb=64 sizes the weight hand-over of the vLLM engines, and this run generates with "
     "--generation-engine textrl"),
])
def test_a_bucket_size_is_refused_out_of_range_or_where_no_weights_are_handed_over(options, message):
    from textrl.config import TrainConfig

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**options).validate()
    TrainConfig(weight_sync_bucket_mb=64, generation_engine="vllm").validate()
    TrainConfig(weight_sync_bucket_mb=64, vllm_server="http://localhost:1").validate()


def test_a_view_of_one_adapter_keeps_its_copy_though_it_lists_only_trained_weights():
    class View(torch.nn.Module):  # as textrl.agents.adapter_views.AdapterPolicy: the adapter's weights only
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2))

        def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
            yield "model.layers.0.q_proj.lora_A.policy.weight", self.weight

    view = View()
    assert all(p.requires_grad for p in view.parameters())
    assert not receives_directly(Receiving(), view)


@pytest.mark.parametrize("receives", [True, False], ids=["receives", "samples-in-place"])
def test_a_rollout_logs_the_seconds_its_engine_spent_taking_weights_only_where_it_takes_them(receives):
    """time/weight_sync_s in the synchronous loop: the engine's hand-over seconds, read once per
    rollout, for an engine that holds its own weights; none for one that samples the policy in place."""
    from tests.agents.conftest import make_agent, target_reward
    from textrl.envs.prompts import encode_prompts
    from textrl.envs.tasks import make_digits_task
    from textrl.models import build_tiny_tokenizer
    from textrl.run.rollout import collect

    class Timed(HFEngine):
        receives_weights = receives
        took = 0

        def take_weight_sync_seconds(self) -> float:
            self.took += 1
            return 0.25

    tok = build_tiny_tokenizer()
    agent = make_agent(tok, "grpo")
    agent.actor.engine = engine = Timed()
    timings: dict[str, float] = {}
    collect(agent, encode_prompts(make_digits_task(4, seed=0), tok)[0], target_reward, timings=timings)
    assert timings.get("weight_sync") == (0.25 if receives else None)
    assert engine.took == (1 if receives else 0)


def test_an_asynchronous_run_with_a_copy_of_the_policy_logs_its_copies_and_holds_its_snapshots_on_the_cpu(
        tmp_path, monkeypatch, capsys):
    """K=1 with the textrl engine (it samples a module: the actor keeps a copy): each rollout's row
    says the seconds of the copies into it (time/weight_sync_s, the first rollout's load), and the
    snapshots the learner publishes are CPU tensors; no line about the prefill check."""
    import textrl.agents.async_actor as async_actor
    from tests.runs import SMALL, metrics
    from textrl.cli import main

    published: list[dict] = []
    state = async_actor.trainable_state
    monkeypatch.setattr("textrl.training.async_training.trainable_state", lambda policy: published.append(state(policy))
                        or published[-1])
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--iterations", "2", "--output-dir", str(out), "--max-staleness", "1"]) == 0
    rows = metrics(out)
    assert rows[0]["time/weight_sync_s"] > 0 and all(r["time/weight_sync_s"] >= 0 for r in rows)
    assert published and all(t.device.type == "cpu" for snapshot in published for t in snapshot.values())
    assert async_actor.PREFILL_CHECK_SKIPPED[:60] not in capsys.readouterr().out
