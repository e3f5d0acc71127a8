"""Seconds to hand a policy's weights to the engine that samples with them, per path, against a plain
copy of the same bytes measured in the same run; and the device bytes an asynchronous actor holds.

    python benchmarks/bench_weight_sync.py                                  # tiny and 0.5B, every path that runs here
    python benchmarks/bench_weight_sync.py --shapes 0.5b --paths floor,twin,colocated
    python benchmarks/bench_weight_sync.py --device cuda --shapes 0.5b,1.5b --paths floor,publish,twin,colocated \\
        --memory-staleness 4                                                # the GPU command (docs/benchmarks.md)

Shapes (random weights built here, nothing downloaded): ``tiny`` (the tiny Llama with heads of 32,
which vLLM's CPU attention runs), ``0.5b`` and ``1.5b`` (Qwen2.5-0.5B's and Qwen2.5-1.5B's configs:
494M and 1.54B parameters, tied embeddings). Paths, each timed ``--repeats`` times (the median
printed):

- ``floor``: one copy of a flat buffer of the weights' bytes to where the engine's weights live (on
  the CPU a memcpy; on CUDA pinned host memory to the device: where a snapshot now comes from);
- ``publish``: :func:`textrl.agents.async_actor.trainable_state`, the learner's snapshot (on CUDA
  into pinned host memory);
- ``fingerprint``: the SHA-256 of the weights, which every vLLM hand-over computes on each side
  (:func:`textrl.generation.weight_sync.fingerprint`): the check's share of the next two;
- ``twin``: a snapshot copied into the actor's own copy of the policy (``textrl`` / ``hf`` engines, a
  LoRA policy's adapters; :meth:`textrl.agents.async_actor.AsyncActor.load`);
- ``colocated``: vLLM in this process (``--generation-engine vllm``) taking a snapshot through
  ``load_weights`` (its layerwise reload in buckets of ``--bucket-mb``, the fingerprints compared);
  the engine's own hand-over seconds (``time/weight_sync_s``), not its generation;
- ``served``: a snapshot pushed to one ``textrl vllm-serve`` server in this machine (``textrl_gloo``
  on the CPU: one packed broadcast a bucket; NCCL on CUDA, which needs a second GPU for the server:
  ``--server URL`` names one already running).

``ratio``: the path's seconds over ``floor``'s (the same bytes, the same run). The memory table: for
``--memory-staleness`` K, the bytes on the policy's device of the actor's copy of the policy plus
the K + 1 published snapshots, before (a copy, the snapshots cloned on the device, as
``trainable_state`` did) and after (no copy for the vLLM engines; snapshots off the device). On
the CPU the device is the host: only the copy's bytes go. One JSON line at the end. A script,
never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

QWEN = {  # Qwen2.5-0.5B's and -1.5B's config.json (their sizes; the weights are random)
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
}


def build(shape: str, dtype: Any, device: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``shape``: the tiny Llama, or a Qwen2 of Qwen2.5's sizes, random, in ``dtype``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    if shape == "tiny":
        model = build_tiny_causal_lm(tok, num_attention_heads=2)
    else:
        config = Qwen2Config(**QWEN[shape], max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval(), tok


def timed(work: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """The median seconds of ``work()`` over ``repeats`` calls (``sync()`` before each clock read)."""
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        work()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def weight_bytes(snapshot: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in snapshot.values())


def floor_copy(snapshot: dict[str, Any], device: str) -> Callable[[], None]:
    """A copy of a flat buffer of the snapshot's bytes to ``device`` (from pinned host memory on CUDA)."""
    import torch

    nbytes = weight_bytes(snapshot)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    return lambda: dst.copy_(src, non_blocking=True)


def twin_copy(model: Any, snapshot: dict[str, Any]) -> Callable[[], None]:
    """:meth:`AsyncActor.load`'s copy of a snapshot into the actor's copy of the policy."""
    import torch

    from textrl.agents.async_actor import policy_copy

    twin = policy_copy(model)
    trained = dict(twin.named_parameters())

    @torch.no_grad()
    def copy() -> None:
        for name, param in trained.items():
            param.copy_(snapshot[name], non_blocking=True)

    return copy


def generate_one(engine: Any, model: Any, tok: Any) -> None:
    """One greedy token of one prompt (what makes an engine take weights it was handed)."""
    import torch

    from textrl.generation import Sampling

    ids = torch.tensor([[tok.bos_token_id or 1, 5, 6]], device=next(model.parameters()).device)
    sampling = Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=1,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        engine.generate(model, ids, torch.ones_like(ids), sampling)


def engine_push(engine: Any, model: Any, tok: Any, snapshot: dict[str, Any], repeats: int) -> float:
    """The median of the engine's own hand-over seconds for ``repeats`` pushes of ``snapshot`` (each
    followed by a one-token call, where it takes them); the first push (start-up) not counted."""
    engine.load_weights(snapshot.items(), 0)
    generate_one(engine, model, tok)
    engine.take_weight_sync_seconds()
    seconds = []
    for version in range(1, repeats + 1):
        engine.load_weights(snapshot.items(), version)
        generate_one(engine, model, tok)
        seconds.append(engine.take_weight_sync_seconds())
    return statistics.median(seconds)


def colocated(model: Any, tok: Any, snapshot: dict[str, Any], args: argparse.Namespace) -> float:
    from textrl.config import TrainConfig
    from textrl.generation.vllm_engine import VLLMEngine

    engine = VLLMEngine()
    engine.configure(TrainConfig(generation_engine="vllm", weight_sync_bucket_mb=args.bucket_mb,
                                 vllm_max_model_length=64, max_staleness=1))
    try:
        return engine_push(engine, model, tok, snapshot, args.repeats)
    finally:
        engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served(model: Any, tok: Any, snapshot: dict[str, Any], args: argparse.Namespace, root: Path) -> float:
    """One server of the model (``textrl vllm-serve``, started here unless ``--server``), pushed to."""
    import torch

    from textrl.generation.vllm_server import VLLMServerEngine

    proc, url = None, args.server
    if url is None:
        folder = root / "model"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        port = free_port()
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        cmd = [sys.executable, "-m", "textrl.cli", "vllm-serve", str(folder), "--port", str(port), "--dtype", dtype,
               "--max-model-len", "64", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"]
        log = (root / "server.log").open("w")
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": str(torch.get_num_threads())}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        from textrl.testing.servers import wait_until_serving

        wait_until_serving(proc, url, root / "server.log", timeout=900)
    engine = VLLMServerEngine([url])
    engine.bucket_bytes = args.bucket_mb * 2**20
    try:
        return engine_push(engine, model, tok, snapshot, args.repeats)
    finally:
        engine.close()
        if proc is not None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=120)


def memory_rows(model: Any, device: str, k: int) -> list[dict[str, Any]]:
    """Device bytes of the actor's copy plus K + 1 snapshots: before (copy, snapshots on the device)
    and after (the vLLM engines: no copy; the others: the copy; snapshots by ``trainable_state``)."""
    import torch

    from textrl.agents.async_actor import device_bytes, policy_copy, trainable_state

    def held(twin: Any, snapshots: list[dict[str, Any]]) -> tuple[int, int]:
        tensors = [*([] if twin is None else twin.parameters()), *(t for s in snapshots for t in s.values())]
        return device_bytes(tensors, device), device_bytes(tensors, "cpu") if device != "cpu" else 0

    rows = []
    for label, make_twin, snapshot in (
            ("before (a copy; snapshots cloned on the device)", True,
             lambda: {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}),
            ("after, vLLM engines (no copy; snapshots off the device)", False, lambda: trainable_state(model)),
            ("after, textrl / hf (a copy; snapshots off the device)", True, lambda: trainable_state(model))):
        twin = policy_copy(model) if make_twin else None
        snapshots = [snapshot() for _ in range(k + 1)]
        on_device, on_host = held(twin, snapshots)
        peak = torch.cuda.memory_allocated() if device == "cuda" else None
        rows.append({"case": label, "device_gb": on_device / 1e9, "host_gb": on_host / 1e9,
                     "cuda_allocated_gb": None if peak is None else peak / 1e9})
        del twin, snapshots
    return rows


def measure(shape: str, paths: list[str], args: argparse.Namespace, sync: Callable[[], None]) -> dict[str, Any]:
    """One shape's row per path (printed as it is measured) and its memory table."""
    import torch

    from textrl.agents.async_actor import trainable_state
    from textrl.generation.weight_sync import fingerprint

    model, tok = build(shape, getattr(torch, args.dtype), args.device)
    snapshot = trainable_state(model)
    nbytes = weight_bytes(snapshot)
    params = sum(p.numel() for p in model.parameters())
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as root:
        for path in paths:
            if path == "floor":
                figures[path] = timed(floor_copy(snapshot, args.device), args.repeats, sync)
            elif path == "publish":
                figures[path] = timed(lambda: trainable_state(model), args.repeats, sync)
            elif path == "fingerprint":
                figures[path] = timed(lambda: fingerprint(snapshot.items()), args.repeats, sync)
            elif path == "twin":
                figures[path] = timed(twin_copy(model, snapshot), args.repeats, sync)
            elif path == "colocated":
                figures[path] = colocated(model, tok, snapshot, args)
            elif path == "served":
                figures[path] = served(model, tok, snapshot, args, Path(root))
            else:
                raise SystemExit(f"--paths: {path!r} is not one of floor, publish, fingerprint, twin, colocated, served")
            ratio = figures[path] / figures["floor"] if figures.get("floor") else float("nan")
            print(f"{shape:<6} {params / 1e6:>7.1f}M {nbytes / 1e9:>6.3f} {path:<12} {figures[path]:>9.4g} {ratio:>7.1f}",
                  flush=True)
    cuda = args.device == "cuda"
    k = args.memory_staleness if args.memory_staleness is not None else (4 if cuda or shape == "tiny" else 1)
    memory = memory_rows(model, args.device, k)
    for row in memory:
        host = f", host {row['host_gb']:.2f} GB" if cuda else ""
        print(f"{shape:<6} K={k} {row['case']}: {row['device_gb']:.3f} GB on {args.device}{host}", flush=True)
    return {"shape": shape, "params": params, "bytes": nbytes, "seconds": figures, "memory_staleness": k,
            "memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,0.5b")
    parser.add_argument("--paths", default="floor,publish,fingerprint,twin,colocated,served")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--server", default=None, help="a running textrl vllm-serve URL of the model (else one is started)")
    parser.add_argument("--memory-staleness", type=int, default=None,
                        help="K of the memory table (default: 4 for tiny, 1 for 0.5B on the CPU; 4 on CUDA)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = args.paths.split(",")
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    print(f"device {args.device} ({torch.cuda.get_device_name() if cuda else os.cpu_count()} "
          f"{'' if cuda else 'CPUs, '}torch {torch.__version__}, {torch.get_num_threads()} threads), {args.dtype}, "
          f"buckets of {args.bucket_mb} MiB, median of {args.repeats}")
    print(f"{'shape':<6} {'params':>8} {'GB':>6} {'path':<12} {'seconds':>9} {'ratio':>7}")
    results = [measure(shape, paths, args, sync) for shape in args.shapes.split(",")]
    print(json.dumps({"device": args.device, "dtype": args.dtype, "bucket_mb": args.bucket_mb, "results": results}))


if __name__ == "__main__":
    main()
