"""Peak GPU memory and seconds per PPO iteration of every agent and of the memory options.

    python benchmarks/bench_gpu_memory.py --list                     # the rows, defaults marked
    python benchmarks/bench_gpu_memory.py --device cuda --budget-s 480 --row-timeout 180 --jsonl rows.jsonl
    python benchmarks/bench_gpu_memory.py --device cuda --rows gae_ppo-0.5b-v512-off,gae_ppo-0.5b-v512-all
    python benchmarks/bench_gpu_memory.py --device cuda --rows gae_ppo-0.5b-v512-off --set ppo_epochs=1
    python benchmarks/bench_gpu_memory.py --device cpu               # tiny sizes, resident memory, ~3 min

A row is an agent, a model shape, a vocabulary and a set of ``TrainConfig`` fields
(``--list`` prints them; ``--rows`` picks some by name, ``--set KEY=VALUE`` overrides a field in
every row). Shapes, built at random init directly on the device in float32 (no download) as Qwen2
models (``Qwen2ForCausalLM``, a ``Qwen2ForSequenceClassification`` reward model of the same shape):

- ``0.5b``: Qwen2-0.5B's, hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied head;
- ``1.5b``: Qwen2-1.5B's, hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, tied head;
- ``7b``: Qwen2-7B's, hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944.

Vocabularies: ``v512``, the tiny tokenizer's 512 tokens, and ``v152k``, Qwen2's 151,936 embedding
rows (``build_tiny_tokenizer(151936)``: the same encoding of every text, plus filler tokens that
only a sampling model emits; each decodes to 2-3 characters, so the reward model reads a response
of 128 random tokens as about 370). Every iteration is 32 prompts of the digits task x 4 samples
x 128 new tokens, every row full length (EOS unreachable), the trainer's defaults otherwise (2
epochs of 2 minibatches, micro-batches of 64), scored by a neural reward model of the policy's
shape (``multi_adapter_ppo``: its LoRA reward adapter on the shared base). So ``gae_ppo`` holds
four models (policy, reference, critic, reward model), as in the first measurement of textrl's
memory on a GPU (46 GB for 0.5B at 512 tokens, all float32, two AdamW states).

Variants: ``off`` (every memory option off where ``TrainConfig`` has it: float32 frozen models,
a separate critic, torch's AdamW, no checkpointing, unchunked log-probs), ``defaults`` (the
``TrainConfig`` defaults: on CUDA the frozen models are bf16), one option over ``off`` (``gc``
gradient checkpointing, ``shared`` / ``lora_critic`` critic, ``frozen_bf16``, ``8bit`` AdamW,
``bf16_anyprec`` bf16 weights with AnyPrecisionAdamW, ``chunk`` log-probs in chunks of 2^24
logits, as the unset field gives on CUDA), ``all`` (gc, shared critic, bf16 frozen models, 8-bit AdamW, chunks),
``all_host`` (``all`` with the NaN guard's copy in host memory, ``rollback_copy='host'``), and for
``multi_adapter_ppo`` ``4bit`` (an NF4 base loaded from a bf16 folder the benchmark writes first,
in a process of its own, cached under ``--workdir``) and ``4bit_all`` (with gc and chunks). A row
that sets a field this ``TrainConfig`` lacks prints ``skipped: TrainConfig has no field X``.

Each row runs in a fresh process (the next one is started, and imports, while a row runs): it builds
its models and the agent (``from_config``, as ``textrl train`` does), then runs iteration 1 (warm-up)
and iteration 2 (timed) of the trainer's ``collect`` + ``update``. On CUDA, ``peak_mb`` is
``torch.cuda.max_memory_allocated`` over the two iterations (reset once the models are built),
``peak_with_build_mb`` the peak since the process started, ``phase_peaks_mb`` the peaks of
``collect`` (generation, reward, rollout forwards) and of ``update`` apart, ``rollback_copy`` where
the NaN guard keeps its copy of the trained state and its size (``auto`` keeps it on a GPU when it
takes at most a tenth of the card: on an H200 that is up to 14 GB counted in the peak;
``--set rollback_copy=host`` moves it off), and with ``--trace`` ``trace``: what a third iteration's
update allocated that was live at its peak, grouped by where (benchmarks/memory_trace.py); on the CPU the same from the resident
set (``ru_maxrss`` over the RSS after the imports, as bench_memory.py measures). An out-of-memory
error makes the row ``OOM`` (its peak so far kept) and the benchmark goes on. ``--row-timeout``
stops a row, ``--budget-s`` stops starting rows (those left are listed as not run); each row's JSON
is printed (``ROW {...}``, flushed) as it finishes. Then a table, then one JSON line last: every row,
its ratio to the ``off`` row of its shape and vocabulary (its own agent's, else ``gae_ppo``'s),
and the memory goals, each met / not met / not run (GB = 10^9 bytes, peak with the build):
``gae_ppo`` 0.5B <= 12 GB, ``gae_ppo`` 1.5B at 152k tokens <= 60 GB, ``rloo`` 1.5B at 152k
<= 40 GB, 7B LoRA on a 4-bit base <= 40 GB.

``--device cpu`` runs the same rows at tiny sizes (hidden 64 / 96 / 128, 2 layers; 4 prompts x 2
samples x 16 tokens; both vocabularies) so a CPU test can run it; its default rows are a subset.
A script, never imported (torchrl ships a top-level ``benchmarks`` package).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The sibling script's resident-memory helpers (its folder is sys.path[0] when run as a script).
from bench_memory import peak_mb, reset_peak, rss_mb, trim_heap, write_reward_adapter

QWEN2_VOCAB = 151936
VOCABS = {"v512": 512, "v152k": QWEN2_VOCAB}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool


SHAPES = {
    "cuda": {
        "0.5b": Shape(896, 24, 14, 2, 4864, True),
        "1.5b": Shape(1536, 28, 12, 2, 8960, True),
        "7b": Shape(3584, 28, 28, 4, 18944, False),
    },
    "cpu": {
        "0.5b": Shape(64, 2, 4, 2, 256, True),
        "1.5b": Shape(96, 2, 4, 2, 384, True),
        "7b": Shape(128, 2, 4, 2, 512, False),
    },
}
SIZES = {"cuda": {"prompts": 32, "samples": 4, "new_tokens": 128},
         "cpu": {"prompts": 4, "samples": 2, "new_tokens": 16}}

OFF = {"gradient_checkpointing": False, "critic": "separate", "frozen_dtype": "float32", "optim": "adamw_torch",
       "logprob_chunk_size": 0}
"""Every memory option off: applied where ``TrainConfig`` has the field (a missing one is off anyway)."""
ONE = {
    "gc": {"gradient_checkpointing": True},
    "shared": {"critic": "shared"},
    "lora_critic": {"critic": "lora"},
    "frozen_bf16": {"frozen_dtype": "bfloat16"},
    "8bit": {"optim": "adamw_bnb_8bit"},
    "bf16_anyprec": {"dtype": "bfloat16", "optim": "adamw_anyprecision"},
    "chunk": {"logprob_chunk_size": "per_vocab"},
}
ALL = {"gradient_checkpointing": True, "critic": "shared", "frozen_dtype": "bfloat16", "optim": "adamw_bnb_8bit",
       "logprob_chunk_size": "per_vocab"}
FOUR_BIT = {"load_in_4bit": True}
FOUR_BIT_ALL = {"load_in_4bit": True, "gradient_checkpointing": True, "logprob_chunk_size": "per_vocab"}
"""``logprob_chunk_size='per_vocab'``: the positions of 2^24 logits at the row's vocabulary (what the
unset field gives on CUDA; set explicitly so that the CPU rows run the fused path too)."""

GOALS = [  # (name, limit in GB, the rows that can meet it: the best one that ran counts)
    ("gae_ppo 0.5B <= 12 GB", 12, ["gae_ppo-0.5b-v512-all", "gae_ppo-0.5b-v152k-all", "gae_ppo-0.5b-v512-all_host"]),
    ("gae_ppo 1.5B 152k vocab <= 60 GB", 60, ["gae_ppo-1.5b-v152k-all", "gae_ppo-1.5b-v152k-all_host"]),
    ("rloo 1.5B 152k vocab <= 40 GB", 40, ["rloo-1.5b-v152k-all", "rloo-1.5b-v152k-all_host"]),
    ("7B LoRA + 4-bit base <= 40 GB", 40, ["multi_adapter_ppo-7b-v152k-4bit", "multi_adapter_ppo-7b-v152k-4bit_all"]),
]


@dataclass
class Row:
    agent: str
    shape: str
    vocab: str
    variant: str
    options: dict[str, Any] = field(default_factory=dict)
    """The fields this row sets (a missing one skips the row)."""
    base: dict[str, Any] = field(default_factory=dict)
    """Fields set where ``TrainConfig`` has them (``OFF``)."""

    @property
    def name(self) -> str:
        return f"{self.agent}-{self.shape}-{self.vocab}-{self.variant}"

    @property
    def needs_folder(self) -> bool:
        """multi_adapter_ppo reads its base (4-bit: from a folder) and reward adapter from disk."""
        return self.agent == "multi_adapter_ppo"


def all_rows() -> list[Row]:
    """Every row, the default ones first in order of importance (:func:`default_rows`)."""
    from textrl.core.agent_registry import agent_names

    def row(agent: str, shape: str, vocab: str, variant: str) -> Row:
        made = _row(agent, shape, vocab, variant)
        if made.options.get("logprob_chunk_size") == "per_vocab":
            made.options["logprob_chunk_size"] = max(1, 2**24 // VOCABS[vocab])
        return made

    def _row(agent: str, shape: str, vocab: str, variant: str) -> Row:
        if variant == "off":
            return Row(agent, shape, vocab, variant, {}, OFF)
        if variant == "defaults":
            return Row(agent, shape, vocab, variant)
        if variant == "all":
            return Row(agent, shape, vocab, variant, dict(ALL), OFF)
        if variant == "all_host":
            return Row(agent, shape, vocab, variant, {**ALL, "rollback_copy": "host"}, OFF)
        if variant == "4bit":
            return Row(agent, shape, vocab, variant, dict(FOUR_BIT))
        if variant == "4bit_all":
            return Row(agent, shape, vocab, variant, dict(FOUR_BIT_ALL))
        return Row(agent, shape, vocab, variant, dict(ONE[variant]), OFF)

    names = [
        "gae_ppo-0.5b-v512-off", "gae_ppo-0.5b-v512-all", "gae_ppo-1.5b-v152k-all", "rloo-1.5b-v152k-all",
        "multi_adapter_ppo-7b-v152k-4bit", "gae_ppo-0.5b-v152k-off", "gae_ppo-0.5b-v152k-all",
        *(f"gae_ppo-0.5b-v512-{v}" for v in ONE),
        "multi_adapter_ppo-0.5b-v152k-4bit", "multi_adapter_ppo-7b-v152k-4bit_all", "gae_ppo-0.5b-v512-all_host",
        "gae_ppo-1.5b-v152k-all_host", "rloo-1.5b-v152k-all_host",
        *(f"{agent}-0.5b-v512-defaults" for agent in agent_names()),
        *(f"gae_ppo-0.5b-v152k-{v}" for v in ONE),
        "gae_ppo-1.5b-v152k-off", "rloo-1.5b-v152k-off", "rloo-0.5b-v512-off", "rloo-0.5b-v512-all",
        "multi_adapter_ppo-0.5b-v512-4bit",
    ]
    out: dict[str, Row] = {}
    for name in names:
        agent, shape, vocab, variant = name.rsplit("-", 3)
        out.setdefault(name, row(agent, shape, vocab, variant))
    return list(out.values())


CPU_DEFAULT_ROWS = [
    "gae_ppo-0.5b-v512-off", "gae_ppo-0.5b-v512-all", "gae_ppo-1.5b-v152k-all", "rloo-1.5b-v152k-all",
    "multi_adapter_ppo-7b-v152k-4bit", "gae_ppo-0.5b-v152k-off",
]
"""``--device cpu``'s default rows: the first of the GPU's order (2-3 minutes on 2 cores)."""


def agent_reads(agent: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less the agent options (``critic``) ``agent`` does not read: a critic-free agent
    runs ``all`` without ``critic='shared'``, which it would refuse."""
    from textrl.config import AGENT_OPTIONS
    from textrl.core.agent_registry import agent_class

    cls = agent_class(agent)
    return {k: v for k, v in options.items() if k not in AGENT_OPTIONS or k in cls.options}


def row_fields(row: Row, overrides: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The ``TrainConfig`` fields of ``row`` (its ``base`` where the fields exist, its options, then
    ``--set``), or the reason it is skipped (a field this ``TrainConfig`` lacks)."""
    from textrl.config import TrainConfig

    have = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in [*row.options, *overrides]:
        if name not in have:
            return {}, f"skipped: TrainConfig has no field {name}"
    fields_ = {k: v for k, v in row.base.items() if k in have}
    fields_.update(row.options)
    fields_.update(overrides)
    return agent_reads(row.agent, fields_), None


# -- the worker: one row (or one folder) in a process of its own ------------------------------------


def build_lm(kind: str, shape: Shape, tokenizer: Any, device: torch.device, seed: int,
             dtype: torch.dtype = torch.float32) -> Any:
    """A random Qwen2 causal LM (``kind='lm'``) or scalar sequence classifier (``'reward'``) of
    ``shape`` with ``tokenizer``'s vocabulary and special ids, built directly on ``device`` in
    ``dtype``, eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=shape.tied and kind == "lm", use_sliding_window=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, num_labels=1,
    )
    cls = Qwen2ForCausalLM if kind == "lm" else Qwen2ForSequenceClassification
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def tokenizer(vocab_size: int) -> Any:
    """The tiny tokenizer, padded to ``vocab_size`` tokens by fillers no text encodes to."""
    from textrl.models import build_tiny_tokenizer

    return build_tiny_tokenizer() if vocab_size == 512 else build_tiny_tokenizer(vocab_size)


def prepare_folder(job: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The base (bf16 safetensors) and a random LoRA reward adapter of ``job``'s shape and vocab
    under ``job['folder']``, for ``multi_adapter_ppo`` (a 4-bit base loads from a folder)."""


    folder = Path(job["folder"])
    if (folder / "DONE").is_file():
        return {"status": "ok", "cached": True}
    start = time.perf_counter()
    tok = tokenizer(job["vocab_size"])
    shape = Shape(**job["shape"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = build_lm("lm", shape, tok, device, seed=0, dtype=dtype)
    base.save_pretrained(folder / "base", max_shard_size="20GB")
    tok.save_pretrained(folder / "base")
    write_reward_adapter(base, shape.hidden, folder / "reward_adapter", folder / "base")
    (folder / "DONE").write_text("{}")
    return {"status": "ok", "cached": False, "seconds": time.perf_counter() - start}


def run_row(job: dict[str, Any], device: torch.device, baseline_rss: float) -> dict[str, Any]:
    """Build the row's models and agent, run two iterations; memory and seconds (module docstring)."""
    from textrl.agents.build import task_reward
    from textrl.config import TrainConfig
    from textrl.core.agent_registry import agent_class
    from textrl.envs import PromptSampler
    from textrl.envs.tasks import make_digits_task
    from textrl.rewards import CompositeReward, NeuralReward
    from textrl.run.rollout import collect

    cuda = device.type == "cuda"
    shape, sizes = Shape(**job["shape"]), job["sizes"]
    out: dict[str, Any] = {"phase": "build", "memory": "cuda_max_allocated" if cuda else "rss_rise"}
    marks: dict[str, float] = {}

    def mark_peak(key: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            marks[key] = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            marks[key] = peak_mb() - baseline_rss

    phase_peaks: dict[str, float] = {}

    def phase_peak(name: str) -> None:
        """On CUDA: the peak of the phase that just ended (``phase_peaks_mb``: where the memory goes),
        kept in ``marks['phases']`` for the row's whole peak, then the counter reset for the next phase."""
        if not cuda:
            return
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        phase_peaks[name] = max(phase_peaks.get(name, 0.0), peak)
        marks["phases"] = max(marks.get("phases", 0.0), peak)
        torch.cuda.reset_peak_memory_stats(device)

    start = time.perf_counter()
    try:
        tok = tokenizer(job["vocab_size"])
        fields_ = dict(job["fields"])
        config_kw = dict(
            agent=job["agent"], tokenizer=tok, device=str(device), prompts_per_iteration=sizes["prompts"],
            n_samples_per_prompt=sizes["samples"], max_new_tokens=sizes["new_tokens"], warmup_sft_steps=0,
            iterations=2, eval_size=0, progress=False, seed=0,
        )
        if job["agent"] == "multi_adapter_ppo":
            folder = Path(job["folder"])
            config_kw.update(model=str(folder / "base"), reward_adapter=str(folder / "reward_adapter"))
            reward_model = None
        else:
            config_kw["model"] = build_lm("lm", shape, tok, device, seed=0)
            reward_model = build_lm("reward", shape, tok, device, seed=1)
        config = TrainConfig(**{**config_kw, **fields_})
        agent = agent_class(config.agent).from_config(config, device, log=lambda *a, **k: None)
        rules = None
        if reward_model is not None:
            neural = NeuralReward(reward_model, tok, batch_size=config.forward_batch_size)  # as --reward-model's
            rules = CompositeReward({"reward_model": neural})
        reward = task_reward(agent, "", rules)  # in frozen_dtype on the device, as textrl train places it
        del reward_model, rules, config_kw
        # Random models stop at random lengths: with EOS unreachable every row is generated to the
        # full max_new_tokens, so rows compare like for like.
        agent.eos_token_id = len(tok) + 1000
        sampler = PromptSampler(make_digits_task(4 * sizes["prompts"], seed=1), tok,
                                prompts_per_batch=sizes["prompts"], n_samples_per_prompt=sizes["samples"], seed=0)
        batches = [sampler.next_batch() for _ in range(3 if job.get("trace") else 2)]
        out["build_s"] = time.perf_counter() - start
        trained = {id(p): p.numel() for opt in agent.optimizers for g in opt.param_groups for p in g["params"]}
        out["parameters"] = {"policy": sum(p.numel() for p in agent.policy.parameters()),
                             "trained": sum(trained.values())}
        out["prompt_tokens"] = int(batches[0].input_ids.shape[1])
        trim_heap()
        mark_peak("build")
        if cuda:
            out["loaded_mb"] = torch.cuda.memory_allocated(device) / 2**20
            torch.cuda.reset_peak_memory_stats(device)
            out["peak_reset_before_iteration"] = True
        else:
            out["loaded_mb"] = rss_mb() - baseline_rss
            out["peak_reset_before_iteration"] = reset_peak()
        seconds, phases = [], {}
        for i, batch in enumerate(batches[:2]):
            out["phase"] = f"iteration {i + 1}"
            torch.manual_seed(i)
            phases = {}
            t0 = time.perf_counter()
            td = collect(agent, batch, reward, timings=phases)
            phase_peak("collect")
            t1 = time.perf_counter()
            agent.update(td)
            if cuda:
                torch.cuda.synchronize(device)
            phases["update"] = time.perf_counter() - t1
            phase_peak("update")
            seconds.append(time.perf_counter() - t0)
            out["tokens"] = int(td.get(("collector", "mask")).sum())
            del td
        out.update(status="ok", phase="done", first_iteration_s=seconds[0], seconds_per_iteration=seconds[1],
                   phases={k: round(v, 3) for k, v in phases.items()})
        if job.get("trace") and cuda:  # a third iteration's update, recorded: what is live at its peak
            from memory_trace import peak_breakdown, recording

            out["phase"] = "iteration 3 (traced)"
            mark_peak("end")  # the peaks above are of the two iterations; the traced one is apart
            torch.manual_seed(2)
            try:
                td = collect(agent, batches[2], reward)
                with recording(device) as trace:
                    agent.update(td)
                del td
                out["trace"] = peak_breakdown(trace.pop("entries", []))
            except Exception as err:  # the two measured iterations stand
                out["trace"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            out["phase"] = "done"
    except (torch.cuda.OutOfMemoryError, MemoryError) as err:
        out.update(status="OOM", error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    except RuntimeError as err:  # the CPU allocator's out of memory is a RuntimeError
        if "can't allocate memory" in str(err) or "out of memory" in str(err):
            out.update(status="OOM", error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        else:
            out.update(status="error", error=f"{type(err).__name__}: {err}"[:600], traceback=traceback.format_exc()[-2000:])
    except Exception as err:  # a row's failure is its result; the benchmark goes on
        out.update(status="error", error=f"{type(err).__name__}: {err}"[:600], traceback=traceback.format_exc()[-2000:])
    if "trace" not in out:
        mark_peak("end")
    marks["end"] = max(marks["end"], marks.get("phases", 0.0))  # the phases' peaks were reset after each
    if phase_peaks:
        out["phase_peaks_mb"] = {k: round(v) for k, v in phase_peaks.items()}
    guard = getattr(getattr(locals().get("agent"), "backend", None), "rollback_copy", None)
    if guard is not None:  # the NaN guard's copy of the trained state: its bytes, on the device or the host
        out["rollback_copy"] = {"placement": guard.placement, "mb": round(guard.nbytes / 2**20)}
    out["peak_mb"] = marks["end"] if "build" in marks else None  # since the reset (None: failed in the build)
    out["peak_with_build_mb"] = max(marks.get("build", 0.0), marks["end"])  # without a reset "end" holds both
    if cuda:
        out["reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
        out["gpu"] = torch.cuda.get_device_name(device)
    out["wall_s"] = time.perf_counter() - start
    return out


def worker(args: argparse.Namespace) -> None:
    """Import everything, then wait for one job on stdin (the parent starts the next row's worker
    while a row runs); print its result."""
    torch.set_num_threads(args.threads)
    import peft  # noqa: F401 - imported before the baseline, so imports do not count
    import transformers  # noqa: F401

    import textrl.agents  # noqa: F401
    import textrl.run.rollout  # noqa: F401

    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass
    line = sys.stdin.readline()
    if not line.strip():
        return  # not needed after all
    job = json.loads(line)
    from textrl.run import resolve_device

    device = resolve_device(args.device)
    if job["kind"] == "prepare":
        result = prepare_folder(job, device)
    else:
        if device.type == "cpu" and job.get("load_in_4bit"):  # bitsandbytes' CPU kernels before the baseline
            import bitsandbytes as bnb

            packed, state = bnb.functional.quantize_4bit(torch.ones(64, 64), quant_type="nf4")
            bnb.functional.dequantize_4bit(packed, state)
        if device.type == "cuda":
            torch.cuda.init()
        trim_heap()
        result = run_row(job, device, rss_mb())
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent: rows in order, one process each ---------------------------------------------------


class Workers:
    """Row processes, the next one started (importing) while the current one runs."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.cmd = [sys.executable, __file__, "--worker", "--device", device, "--threads", str(args.threads)]
        self.prespawn = args.prespawn
        self.ready: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)

    def run(self, job: dict[str, Any], timeout: float, more: bool) -> dict[str, Any]:
        """Run ``job`` in a worker within ``timeout`` seconds; ``more``: start the next worker now."""
        proc, self.ready = self.ready or self._start(), None
        if more and self.prespawn:
            self.ready = self._start()
        try:
            stdout, stderr = proc.communicate(json.dumps(job) + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            return {"status": "timeout", "error": f"stopped after {timeout:.0f}s (--row-timeout / --budget-s)",
                    **_last_result(stdout)}
        found = _last_result(stdout)
        if found:
            return found
        tail = (stderr or "").strip().splitlines()[-3:]
        oom = "OutOfMemoryError" in (stderr or "") or proc.returncode in (-9, 137)
        return {"status": "OOM" if oom else "error",
                "error": f"worker exited {proc.returncode}: {' | '.join(tail)}"[:600]}

    def close(self) -> None:
        if self.ready is not None:
            self.ready.communicate("\n", timeout=60)
            self.ready = None


def _last_result(stdout: str) -> dict[str, Any]:
    lines = [ln for ln in (stdout or "").splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {}


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs, values read as YAML scalars (``true``, ``4096``, ``null``)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (a TrainConfig field)")
        out[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return out


def pick_rows(args: argparse.Namespace, device_type: str) -> list[Row]:
    rows = all_rows()
    by_name = {r.name: r for r in rows}
    if args.rows:
        names = [n.strip() for n in args.rows.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"--rows: no row {', '.join(unknown)}; --list names them")
        return [by_name[n] for n in names]
    if device_type == "cpu":
        return [by_name[n] for n in CPU_DEFAULT_ROWS]
    return rows


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each row's peak over the ``off`` row of its shape and vocabulary (its agent's, else gae_ppo's)."""
    out = {}
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        agent, shape, vocab, _ = name.rsplit("-", 3)
        for base in (f"{agent}-{shape}-{vocab}-off", f"gae_ppo-{shape}-{vocab}-off"):
            b = results.get(base)
            if b and b.get("status") == "ok" and base != name:
                out[name] = {"to": base, "peak": round(r["peak_mb"] / b["peak_mb"], 3),
                             "peak_with_build": round(r["peak_with_build_mb"] / b["peak_with_build_mb"], 3)}
                break
    return out


def goals(results: dict[str, dict[str, Any]], device_type: str) -> dict[str, dict[str, Any]]:
    out = {}
    for goal, limit_gb, names in GOALS:
        if device_type != "cuda":
            out[goal] = {"status": "not run (CPU sizes)"}
            continue
        ran = {n: results[n] for n in names if results.get(n, {}).get("status") in ("ok", "OOM")}
        ok = {n: r["peak_with_build_mb"] * 2**20 / 1e9 for n, r in ran.items() if r["status"] == "ok"}
        if not ran:
            out[goal] = {"status": "not run", "rows": names}
        elif ok and min(ok.values()) <= limit_gb:
            best = min(ok, key=ok.get)
            out[goal] = {"status": "met", "row": best, "gb": round(ok[best], 2)}
        else:
            best = min(ok, key=ok.get) if ok else next(iter(ran))
            out[goal] = {"status": "not met", "row": best, "gb": round(ok[best], 2) if ok else "OOM"}
    return out


def print_table(results: dict[str, dict[str, Any]], ratio: dict[str, dict[str, Any]], unit: str) -> None:
    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    print(f"peak in {unit}; x off: the peak with the build over the off row's (its agent's, else gae_ppo's)")
    print(f"{'row':<42}{'status':>8}{'loaded':>10}{'peak':>10}{'w/ build':>10}{'x off':>7}{'s/iter':>9}{'1st s':>8}")
    for name, r in results.items():
        status = r.get("status", "?")
        status = "skipped" if status.startswith("skipped") else status
        print(f"{name:<42}{status:>8}{num(r.get('loaded_mb'), '.0f'):>10}{num(r.get('peak_mb'), '.0f'):>10}"
              f"{num(r.get('peak_with_build_mb'), '.0f'):>10}{num(ratio.get(name, {}).get('peak_with_build'), '.2f'):>7}"
              f"{num(r.get('seconds_per_iteration'), '.2f'):>9}{num(r.get('first_iteration_s'), '.2f'):>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--rows", default="", help="comma list of row names (--list); default: the device's defaults")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a TrainConfig field for every row (repeatable), e.g. --set ppo_epochs=1")
    parser.add_argument("--prompts", type=int, help="prompts per iteration (default 32 on CUDA, 4 on the CPU)")
    parser.add_argument("--samples", type=int, help="samples per prompt (default 4 on CUDA, 2 on the CPU)")
    parser.add_argument("--new-tokens", type=int, help="max new tokens (default 128 on CUDA, 16 on the CPU)")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds a row may run")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no row after this many seconds (and stop one at it); default: no limit")
    parser.add_argument("--min-row-s", type=float, default=20.0, help="start no row with less budget left than this")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the multi_adapter_ppo folders here (default: a temp dir)")
    parser.add_argument("--jsonl", type=Path, default=None, help="also append each row's JSON line to this file")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each row's process")
    parser.add_argument("--no-prespawn", dest="prespawn", action="store_false",
                        help="start each row's process only when the row starts (no overlap of imports)")
    parser.add_argument("--trace", action="store_true",
                        help="CUDA: a third iteration's update recorded by the allocator; each row's 'trace' says "
                             "what it allocated that was live at its peak (benchmarks/memory_trace.py)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a row's process
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from textrl.run import resolve_device

    device = resolve_device(args.device)  # an unavailable CUDA device is named before anything runs
    if args.trace and device.type != "cuda":
        parser.error(f"--trace records CUDA's allocator; the device is {device}: drop --trace or use --device cuda")
    dtype_key = "cuda" if device.type == "cuda" else "cpu"
    shapes = SHAPES[dtype_key]
    sizes = {**SIZES[dtype_key], **{k: v for k, v in (("prompts", args.prompts), ("samples", args.samples),
                                                       ("new_tokens", args.new_tokens)) if v is not None}}
    overrides = parse_sets(args.set)
    rows = pick_rows(args, dtype_key)
    if args.list:
        print("every row runs by default on CUDA, in this order; cpu: a default row on the CPU; fields: besides "
              f"the TrainConfig defaults (off = {json.dumps(OFF)} where the fields exist)")
        for r in all_rows():
            fields_ = ("off + " if r.base else "") + (json.dumps(r.options) if r.options else "")
            print(f"{r.name:<42} {'cpu' if r.name in CPU_DEFAULT_ROWS else '':<4} {fields_.strip(' +') or '-'}")
        return

    import tempfile

    tmp = tempfile.TemporaryDirectory()
    workdir = args.workdir or Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"device {device}, sizes {sizes}, rows {len(rows)}, budget {args.budget_s or 'none'} s, "
          f"row timeout {args.row_timeout:.0f} s", flush=True)
    workers = Workers(args, str(device))
    results: dict[str, dict[str, Any]] = {}
    not_run: list[str] = []
    start = time.perf_counter()
    try:
        for index, row in enumerate(rows):
            left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
            if left is not None and left < args.min_row_s:
                not_run = [r.name for r in rows[index:]]
                break
            fields_, skipped = row_fields(row, overrides)
            t0 = time.perf_counter()
            if skipped:
                result: dict[str, Any] = {"status": skipped}
            else:
                timeout = args.row_timeout if left is None else min(args.row_timeout, left)
                job = {"kind": "row", "agent": row.agent, "shape": dataclasses.asdict(shapes[row.shape]),
                       "vocab_size": VOCABS[row.vocab], "sizes": sizes, "fields": fields_,
                       "load_in_4bit": bool(fields_.get("load_in_4bit")), "trace": args.trace}
                result = {}
                if row.needs_folder:
                    folder = workdir / f"{row.shape}-{row.vocab}"
                    job["folder"] = str(folder)
                    prep = workers.run({**job, "kind": "prepare"}, timeout, more=True)
                    result["prepare_s"] = round(time.perf_counter() - t0, 1)
                    if prep.get("status") != "ok":
                        result.update(status=prep.get("status", "error"),
                                      error=f"writing the base folder: {prep.get('error', '')}")
                    timeout -= time.perf_counter() - t0
                if not result.get("status"):
                    result.update(workers.run(job, max(timeout, 1.0), more=index + 1 < len(rows)))
            result = {"row": row.name, **result, "fields": fields_,
                      "row_s": round(time.perf_counter() - t0, 1)}
            results[row.name] = result
            line = json.dumps(result)
            print("ROW " + line, flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(line + "\n")
    finally:
        workers.close()
        tmp.cleanup()

    ratio = ratios(results)
    unit = "MiB (CUDA max allocated)" if device.type == "cuda" else "MiB (RSS rise)"
    print_table(results, ratio, unit)
    goal = goals(results, device.type)
    for name, g in goal.items():
        print(f"goal {name}: {g['status']}" + (f" ({g['row']}: {g['gb']} GB)" if "row" in g else ""))
    if not_run:
        print(f"not run (budget of {args.budget_s:.0f} s spent): {', '.join(not_run)}")
    print(json.dumps({
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "memory": "cuda_max_allocated" if device.type == "cuda" else "rss_rise", "unit": "MiB",
        "sizes": sizes, "shapes": {k: dataclasses.asdict(v) for k, v in shapes.items()},
        "overrides": overrides, "rows": results, "ratios": ratio, "goals": goal, "not_run": not_run,
        "seconds": round(time.perf_counter() - start, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
