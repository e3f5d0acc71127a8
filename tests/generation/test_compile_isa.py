"""The compiled step under two CPU ISAs that share one inductor cache (textrl/generation/graph.py,
``compile_options``): what an AVX2-only machine, or ``ATEN_CPU_CAPABILITY``, gets from the engine.

Each run is a process of its own with ATen's kernels *and* inductor's C++ forced to one ISA
(``ATEN_CPU_CAPABILITY``, which inductor follows), both over one fresh ``TORCHINDUCTOR_CACHE_DIR``:
the machine's own ISA first, then a narrower one (AVX-512 -> AVX2, AVX2 -> scalar), which finds the
first run's entries in the cache. Without the vector width in the compile options the second run
compiled the first's AVX-512 C++ for AVX2 and decoded ``pad`` after the first token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# (ATEN_CPU_CAPABILITY, the capability torch reports, inductor's vector width in bits)
ISAS = {"AVX512": ("avx512", "AVX512", 512), "AVX2": ("avx2", "AVX2", 256), "DEFAULT": ("default", "DEFAULT", 0)}
NARROWER = {"AVX512": "AVX2", "AVX2": "DEFAULT"}

RUN = r"""
import json, torch
from textrl.generation import DecodeEngine, HFEngine, Sampling
from textrl.generation.graph import compile_options
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

torch.set_num_threads(1)
tok = build_tiny_tokenizer()
model = build_tiny_causal_lm(tok, num_hidden_layers=1).eval()
enc = tok(["What is 1+2?", "hi", "Count to 3 please, slowly", "a b c d"], return_tensors="pt", padding=True)
sampling = Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8, eos_token_id=None, pad_token_id=tok.pad_token_id)
with torch.no_grad():
    got = DecodeEngine(compile=True).generate(model, enc["input_ids"], enc["attention_mask"], sampling)
    want = HFEngine().generate(model, enc["input_ids"], enc["attention_mask"], sampling)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "simdlen": compile_options(torch.device("cpu"))["cpp.simdlen"],
                  "got": got.tolist(), "want": want.tolist()}))
"""


def decode_under(isa: str, cache: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": ISAS[isa][0], "TORCHINDUCTOR_CACHE_DIR": cache,
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the compiled step under {isa} ended with {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_compiled_step_decodes_what_generate_does_under_two_isas_sharing_one_cache(tmp_path):
    own = torch.backends.cpu.get_cpu_capability()
    if own not in NARROWER:
        pytest.skip(f"this CPU's capability is {own}: no narrower x86 ISA to force")
    for isa in (own, NARROWER[own]):
        out = decode_under(isa, str(tmp_path / "inductor"))
        assert (out["capability"], out["simdlen"]) == ISAS[isa][1:], isa  # both ISAs forced
        assert out["got"] == out["want"], f"under {isa} after {own} filled the cache"
