"""The ``textrl`` command.

Subcommands available in this version:

- ``textrl train``: PPO on a prompt set with pluggable rewards; with no arguments, the embedded
  CPU default (tiny offline model, a short format warm-up, RLOO on the built-in digits task).
- ``textrl envs``: list the environments ``textrl train --env ID`` takes, a line each.
- ``textrl tiny``: build (or find in the cache) the offline tiny models and print where they are.
- ``textrl generate``: generate from a causal LM (a local path, a hub id, ``tiny``, or a LoRA
  adapter folder) with its chat template, greedy or sampled.
- ``textrl sft``: supervised fine-tuning with the completion-only loss (full or LoRA, 4-bit base).
- ``textrl rm``: reward-model training (pairwise loss); a full model or a LoRA reward adapter.
- ``textrl dpo``: DPO with the sigmoid loss against the starting model.
- ``textrl merge``: merge a LoRA adapter into its base and save a full model.
- ``textrl pipeline``: SFT -> reward model -> PPO; with no arguments, the offline demo.
- ``textrl vllm-serve MODEL [vLLM's options]``: a vLLM server for ``textrl train --vllm-server``
  (``vllm serve`` with the weight-transfer and log-prob settings textrl's rollouts need).
- ``textrl bench``: agents x environments x seeds at an equal token budget, with a significance
  report and plots.

Each stage accepts ``--config file.yaml`` and one flag per config field (``--help`` lists them).
Any error ends the command with one line naming the culprit and the fix (two for an error
raised outside textrl's checks: its type, then how to see the traceback); ``--debug`` (or
``TEXTRL_DEBUG=1``) shows the traceback instead (:mod:`textrl.errors`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_train(args: argparse.Namespace) -> int:
    from textrl.config import TrainConfig, build_config
    from textrl.errors import alike_in_every_process
    from textrl.training.run_checks import check_run
    from textrl.training.trainer import train

    with alike_in_every_process(getattr(args, "debug", False)):  # under torchrun: said once, not by every process
        config: TrainConfig = build_config(args, TrainConfig)
        check_run(config)  # every field, the reward names, the output folder: before any model loads
    global _HARD_EXIT
    try:
        train(config)
    finally:
        grouped = _close_process_group()
    _HARD_EXIT = grouped  # succeeded under a process group
    return 0


_HARD_EXIT = False
"""Set once a ``textrl train`` under a process group succeeded: :func:`entry` ends the process with ``os._exit``."""


def _close_process_group() -> bool:
    """Destroy the process group ``accelerate`` / torchrun set up, if any, before the interpreter
    exits: left to static destruction, its communication threads can abort the process (SIGABRT,
    "terminate called without an active exception") after a run that succeeded. Whether there was one."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        return True
    return False


def _cmd_envs(args: argparse.Namespace) -> int:
    from textrl.envs.registry import ENV_LOADERS, ENVS, env_ids, env_settings, gym_id, make_env

    ids = env_ids()
    width = max(len(i) for i in ids)
    for env_id in ids:
        settings = ", ".join(env_settings(ENVS[env_id]))
        print(f"{env_id:<{width}}  {make_env(env_id).describe()}  [{gym_id(env_id)}]"
              + (f"\n{'':<{width}}  --env-args: {settings}" if settings else ""))
    for scheme in sorted(ENV_LOADERS):
        doc = (ENV_LOADERS[scheme].__doc__ or "").strip().splitlines()
        print(f"{scheme + ':NAME':<{width}}  {doc[0] if doc else 'adapter'}")
    print("PATH.py:Class".ljust(width) + "  an Environment subclass in your own file")
    return 0


def _cmd_tiny(args: argparse.Namespace) -> int:
    from textrl.models import tiny_model_path

    for kind in ("causal_lm", "reward_model", "gpt2"):
        path = tiny_model_path(kind, seed=args.seed, cache_dir=args.cache_dir)
        print(f"{kind}: {path}")
    return 0


def _cmd_vllm_serve(args: argparse.Namespace) -> int:
    """Replace this process by ``vllm serve`` (:func:`textrl.generation.vllm.serve_command.serve_command`)."""
    import os

    import torch

    from textrl.core.quiet import environment_before_quiet
    from textrl.generation.vllm.checks import import_vllm
    from textrl.generation.vllm.serve_command import serve_command

    import_vllm()  # one line naming what to install, before the server starts
    argv, env = serve_command(args.model, args.vllm_args, cuda=torch.cuda.is_available(), reward=args.reward_model)
    sys.stdout.flush()
    os.execve(argv[0], argv, {**environment_before_quiet(), **env})  # vLLM's server log is the user's to read
    return 0  # pragma: no cover - execve does not return


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from textrl.models import load_causal_lm, load_tokenizer

    if args.max_new_tokens < 1:
        raise SystemExit(f"textrl generate: --max-new-tokens={args.max_new_tokens}: must be >= 1")
    if args.temperature <= 0:
        raise SystemExit(f"textrl generate: --temperature={args.temperature}: must be > 0 (use --greedy)")
    torch.manual_seed(args.seed)
    from textrl.stages.common import is_adapter_dir, load_adapter_model

    args.model = run_policy(args.model)  # a run folder or one of its checkpoints: the policy it saved
    if is_adapter_dir(args.model):  # a LoRA adapter folder: its base plus the adapter
        model = load_adapter_model(args.model, device=args.device)
        tokenizer = load_tokenizer(args.tokenizer or args.model)
    else:
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        model = load_causal_lm(args.model, device=args.device)
    prompts = args.prompt or ["What is 2+3?"]
    _check_generate_fits(model, tokenizer, prompts, args)
    from textrl.models.sampling import inference_notice

    notice = inference_notice(model)  # inference keeps the folder's processors; training does not
    if notice:
        print(f"textrl generate: {notice}", file=sys.stderr)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        if tokenizer.chat_template
        else p
        for p in prompts
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    sampling = {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": args.temperature}
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    for prompt, completion in zip(prompts, completions):
        print(f"### prompt\n{prompt}\n### completion\n{completion}\n")
    return 0


def run_policy(model: str) -> str:
    """``textrl generate --model``'s path: a checkpoint of a ``textrl train`` run (``RUN/checkpoints/
    iter_NNNNNN``) gives its ``policy/`` (the model and tokenizer it saved); a run folder, or its
    ``checkpoints/`` folder, the newest complete checkpoint's (:func:`textrl.run.checkpoints.
    complete_checkpoints`); either is said in one line on stderr. Anything else (a model folder, a
    hub id, ``tiny``, an adapter folder) is returned as it is. ``ValueError`` naming the folder for a
    checkpoint whose save did not finish and for a run without a complete checkpoint."""
    from pathlib import Path

    from textrl.run.checkpoints import CHECKPOINT_MARKER, complete_checkpoints

    folder = Path(model).expanduser()
    if not folder.is_dir() or (folder / "config.json").is_file():
        return model
    if (folder / "policy").is_dir():  # a checkpoint: policy/ beside its manifest
        if not (folder / CHECKPOINT_MARKER).is_file():
            raise ValueError(f"--model {model}: a checkpoint without {CHECKPOINT_MARKER} (its save did not finish); "
                             f"give the run folder for its newest complete checkpoint, or --model {folder / 'policy'} "
                             "to load that folder as it is")
        print(f"textrl generate: the policy of checkpoint {folder}: {folder / 'policy'}", file=sys.stderr)
        return str(folder / "policy")
    root = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    if root is folder and not any(folder.glob("iter_*")):
        return model
    found = complete_checkpoints(root)
    if not found:
        raise ValueError(f"--model {model}: a run folder with no complete checkpoint in {root}; "
                         "give a model folder, a hub id, or a run that saved a checkpoint")
    run = folder if root is not folder else folder.parent
    print(f"textrl generate: the policy of {run}'s newest checkpoint: {found[-1] / 'policy'}", file=sys.stderr)
    return str(found[-1] / "policy")


def _check_generate_fits(model, tokenizer, prompts: list[str], args: argparse.Namespace) -> None:
    """``textrl train``'s context check for ``textrl generate``: each prompt (templated) plus
    ``--max-new-tokens`` fits the model's context; ``SystemExit`` naming the prompt and the lever."""
    import re

    from textrl.envs import check_prompts_fit
    from textrl.models.checks import context_length

    found = context_length(model)
    if found is None:
        return
    context, field = found
    try:
        check_prompts_fit([{"prompt": p} for p in prompts], tokenizer, context=context, context_field=field,
                          model=str(args.model), max_new_tokens=args.max_new_tokens)
    except ValueError as error:
        message = re.sub(r"list\[(\d+)\]", lambda m: f"--prompt {int(m.group(1)) + 1}", str(error))
        raise SystemExit(f"textrl generate: {message.replace(chr(10), ' ')}") from None


def _stage_command(name: str, config_cls: type, run, describe):
    """The function of subcommand ``name``: config from defaults < YAML < flags, run, report
    (a user's error is reported by :func:`main`)."""

    def command(args: argparse.Namespace) -> int:
        from textrl.config import build_config

        print(describe(run(build_config(args, config_cls).validate())))
        return 0

    return command


STAGES = {
    "sft": "supervised fine-tuning with the completion-only loss (full or LoRA)",
    "rm": "reward-model training with the pairwise loss",
    "dpo": "DPO (sigmoid loss) against the starting model",
    "merge": "merge a LoRA adapter into its base and save a full model",
    "pipeline": "SFT -> reward model -> PPO (no arguments: the offline demo)",
}
"""The stage subcommands (:mod:`textrl.stages`) and their one-line help."""


def _add_stages(sub, command: str | None = None) -> None:
    """``sft``, ``rm``, ``dpo``, ``merge`` and ``pipeline`` from :mod:`textrl.stages`; with
    ``command``, the options of that one only (the others are listed by name and help)."""
    for name, help_text in STAGES.items():
        if command is not None and command != name:
            sub.add_parser(name, help=help_text)
            continue
        import importlib

        from textrl.stages.common import add_stage_arguments

        module = importlib.import_module(f"textrl.stages.{name}")
        config_cls, run, describe = {
            "sft": lambda m: (m.SFTConfig, m.train_sft, m.format_sft_summary),
            "rm": lambda m: (m.RMConfig, m.train_rm, m.format_rm_summary),
            "dpo": lambda m: (m.DPOConfig, m.train_dpo, m.format_dpo_summary),
            "merge": lambda m: (m.MergeConfig, m.merge, m.format_merge_result),
            "pipeline": lambda m: (m.PipelineConfig, m.run_pipeline, m.format_pipeline_summary),
        }[name](module)
        parser = sub.add_parser(name, help=help_text, description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        add_stage_arguments(parser, config_cls)
        parser.set_defaults(func=_stage_command(name, config_cls, run, describe))


def _list_agents_in_help(parser: argparse.ArgumentParser) -> None:
    """``--agent``'s help names every agent (:func:`textrl.core.agent_registry.listed_agent_names`: the
    built-ins and installed packages', without importing them) and the default agent
    (``TrainConfig.agent``, the only place it is written)."""
    from textrl.config import TrainConfig
    from textrl.core.agent_registry import listed_agent_names

    for action in parser._actions:
        if action.dest == "agent":
            action.help = (f"Agent: one of {', '.join(listed_agent_names())} (registered names), or "
                           f"path/to/file.py:Class for an agent of your own (default: {TrainConfig.agent!r})")


def _add_train(sub) -> None:
    from textrl.config import TrainConfig, add_config_arguments, add_trl_names

    train = sub.add_parser("train", help="PPO training (no arguments: the embedded CPU default)",
                           usage="textrl train [--config FILE.yaml] [OPTION VALUE ...]", description="PPO training; with no arguments, the embedded CPU default. Options by topic "
                                       "below; a --config YAML file holds any of them (flags override it).",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    train.add_argument("--config", default=None, help="YAML file of options (flags override it)")
    add_config_arguments(train, TrainConfig)
    add_trl_names(train, TrainConfig)
    _list_agents_in_help(train)
    train.set_defaults(func=_cmd_train)


def _add_bench(sub) -> None:
    from textrl import bench as bench_module

    bench = sub.add_parser("bench", help="compare agents x environments x seeds: significance report + plots",
                           description=bench_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_module.add_arguments(bench)
    bench.set_defaults(func=bench_module.run)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``textrl`` parser. ``command``: build the options of that subcommand only (the others are
    listed with their one-line help, their options left out), so that ``textrl train --help`` does
    not import what ``textrl bench`` needs; None builds every subcommand's options."""
    from textrl import __version__

    parser = argparse.ArgumentParser(prog="textrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"textrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def wanted(name: str) -> bool:
        return command is None or command == name

    if wanted("train"):
        _add_train(sub)
    else:
        sub.add_parser("train", help="PPO training (no arguments: the embedded CPU default)")

    envs = sub.add_parser("envs", help="list the environments `textrl train --env` takes")
    envs.set_defaults(func=_cmd_envs)

    tiny = sub.add_parser("tiny", help="build or locate the offline tiny models")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--cache-dir", default=None, help="default: $TEXTRL_CACHE or ~/.cache/textrl")
    tiny.set_defaults(func=_cmd_tiny)

    gen = sub.add_parser("generate", help="generate completions from a causal LM")
    gen.add_argument("--model", default="tiny",
                     help="local path, hub id, 'tiny' (default), a LoRA adapter folder, a checkpoint of a "
                          "textrl train run (RUN/checkpoints/iter_NNNNNN) or a run folder (its newest checkpoint)")
    gen.add_argument("--tokenizer", default=None, help="a tokenizer folder or hub id (default: the model's own)")
    gen.add_argument("--prompt", action="append", help="a user message (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: 'cpu')")
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("vllm-serve", help="a vLLM server for textrl train --vllm-server (docs/vllm.md)",
                           description="vllm serve MODEL with the settings textrl's rollouts and weight updates need "
                                       "(vLLM's RL routes, the weight-transfer backend, processed log-probs); every "
                                       "other option is vLLM's own and passed on (vllm serve --help lists them)")
    serve.add_argument("--reward-model", action="store_true",
                       help="serve a reward model for --reward reward_model:URL (vLLM's pooling runner) instead of "
                            "the policy (give it before MODEL)")
    serve.add_argument("model", help="the model folder or hub id the run trains (its --model), or with --reward-model "
                                     "the reward model")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM's options, e.g. --port 8001 --max-model-len 1024")
    serve.set_defaults(func=_cmd_vllm_serve)

    _add_stages(sub, command)

    if wanted("bench"):
        _add_bench(sub)
    else:
        sub.add_parser("bench", help="compare agents x environments x seeds: significance report + plots")
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option); None when it names none."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` on every subcommand: the traceback of an error instead of its one line."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.add_argument("--debug", action="store_true",
                                 help="show the traceback of an error (also: TEXTRL_DEBUG=1)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; any error exits with status 1 and one line (textrl's own checks: the
    culprit and the fix) or two (another error: its type and message, then how to see the
    traceback: :func:`textrl.errors.user_error_message`); ``--debug``: the traceback. A second
    Ctrl-C exits with 130; a ``SystemExit`` (a stopped run's status) passes as it is. A stdout its
    reader closed (``textrl envs | head -1``) ends the command quietly with 141, as SIGPIPE would."""
    from textrl.errors import debug_requested, user_error_message

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_of(argv) or "")  # only the named subcommand's options are built
    _add_debug_flag(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # --help, --version or a usage error, printed: argparse ignores a closed stdout
        if _stdout_closed():
            raise SystemExit(CLOSED_PIPE_STATUS) from None
        raise
    from textrl.core.quiet import quiet_libraries

    try:
        with quiet_libraries(debug_requested(getattr(args, "debug", False))):  # other libraries' chatter, unless --debug
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed stdout is met here, not in the interpreter's exit (status 120 and a message)
        return code
    except BrokenPipeError:  # the reader of our output closed it (`textrl envs | head -2`): end quietly
        _stdout_to_devnull()
        return CLOSED_PIPE_STATUS
    except Exception as err:  # every error: one line (two: its type and the --debug hint), no traceback
        if debug_requested(getattr(args, "debug", False)):
            raise
        # a value that came from --config's file is named with the file (edit it there)
        from textrl.config.io import name_config_sources

        raise SystemExit(name_config_sources(user_error_message(args.command, err),
                                             getattr(args, "config_sources", {}))) from None
    except KeyboardInterrupt:
        if debug_requested(getattr(args, "debug", False)):
            raise
        print(f"textrl {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


CLOSED_PIPE_STATUS = 128 + 13
"""The status of a command whose reader closed its output: a Unix tool's, killed by SIGPIPE."""


def _stdout_closed() -> bool:
    """Flush stdout; True when its reader had closed it (stdout then goes to ``/dev/null``)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return True
    return False


def _stdout_to_devnull() -> None:
    """Point the process's stdout at ``/dev/null``: what is left in its buffer, flushed at exit, then
    goes nowhere instead of raising ``BrokenPipeError`` again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def entry() -> None:
    """The ``textrl`` command: :func:`main`, then exit with its status. A process of a multi-process
    run (torchrun, accelerate) whose run succeeded ends with ``os._exit`` once its output is flushed:
    even with the process group destroyed, the C++ threads a distributed run leaves (gloo's, DeepSpeed's)
    were seen to abort the interpreter's teardown now and then ("terminate called without an active
    exception", SIGABRT after ``summary.json`` was written), which turned a finished run's status into
    a failure. Everything the run writes is closed before :func:`main` returns."""
    code = main()
    if _HARD_EXIT:
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
