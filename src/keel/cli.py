"""keel's command line: parse arguments, call the library, turn user errors into exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import NoReturn

from keel.cli_convert import add_convert, run_convert, show_translation
from keel.cli_predict import add_predict, run_predict
from keel.cli_serve import add_serve, parse_size, run_serve
from keel.cli_their import add_their_config, fill_from_their_config
from keel.console import quiet_libraries, say
from keel.errors import ConfigError, KeelError

EPILOG = "Overrides: any config key as key.sub=value, e.g. train.lr=1e-4 data.packing=true"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description="Fine-tune LLMs from one YAML.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show technical set-up lines and the libraries' progress bars",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_validate(sub)
    _add_chat(sub)
    _add_plan(sub)
    _add_doctor(sub)
    _add_export(sub)
    _add_expand(sub)
    add_predict(sub)
    add_serve(sub)
    add_convert(sub)
    return parser


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train a model from a YAML config", epilog=EPILOG)
    train.add_argument("config", help="path to the run's YAML config")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    # Multi-process runs go through torchrun; see keel.distributed.launch.
    train.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="start N worker processes on this node via torchrun "
        "(usually one per GPU); default: one process, no launcher",
    )
    train.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="number of nodes; run the same command on each (default 1)",
    )
    train.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this node's index, 0..nnodes-1 (default 0)",
    )
    train.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="address of node 0, the same on every node; needed with --nnodes > 1",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart all workers up to N times after a failure (default 0)",
    )
    train.add_argument(
        "--force",
        action="store_true",
        help="train even when the memory plan says it does not fit (same as distributed.plan=warn)",
    )


def _add_validate(sub) -> None:
    check = sub.add_parser(
        "validate", epilog=EPILOG, help="check a config and its data (report only, no training)"
    )
    check.add_argument("config")
    check.add_argument("overrides", nargs="*")
    # The world `keel train` would get from the same flags: the steps line counts it (without
    # train.global_batch_size, each process adds micro_batch_size x grad_accum rows a step).
    check.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="count steps as N processes per node would train (as keel train --nproc N)",
    )
    check.add_argument(
        "--nnodes", type=int, default=1, metavar="N", help="with N nodes (as keel train)"
    )


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="chat with a model (interactive, or one --prompt)")
    add_their_config(chat)
    chat.add_argument(
        "--model",
        help="HF model dir, Hugging Face Hub id (owner/name), keel output dir, "
        "or bundled:smollm2-135m-instruct",
    )
    chat.add_argument("--adapter", help="a PEFT adapter dir to apply on top of --model")
    chat.add_argument("--prompt", help="answer this one prompt and exit")
    chat.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for a vision-language model (repeatable): one per <image> in the "
        "prompt, or placed before the text when it has none",
    )
    chat.add_argument("--system", help="system prompt (default: the template's own)")
    chat.add_argument("--max-new-tokens", type=int, help="default 256")
    chat.add_argument("--temperature", type=float, help="0 (the default) means greedy")
    chat.add_argument("--top-p", type=float, help="default 1")
    chat.add_argument(
        "--cache-dir", default="~/.cache/keel", help="where bundled models are converted"
    )


def _add_plan(sub) -> None:
    plan = sub.add_parser(
        "plan", epilog=EPILOG, help="memory per device of each strategy, from the config alone"
    )
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="plan for N GPUs per node (default: this machine's devices)",
    )
    plan.add_argument(
        "--nodes", type=int, default=1, metavar="M", help="number of nodes (default 1)"
    )
    plan.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="memory of one device, e.g. 24GiB or 80GB (default: "
        "distributed.device_memory, else detected)",
    )
    plan.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document on stdout (messages go to stderr)",
    )


def _add_doctor(sub) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="can this machine train? versions, devices, "
        "backends and a real 2-process test (exit 1: no)",
    )
    doctor.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document on stdout (messages go to stderr)",
    )


def _add_export(sub) -> None:
    export = sub.add_parser(
        "export",
        help="merge an adapter or checkpoint into its base; write one Hugging Face model dir",
    )
    add_their_config(export)
    export.add_argument(
        "--model",
        help="HF model dir, Hugging Face Hub id (owner/name), keel output dir, "
        "checkpoints/step-N dir, or bundled:NAME",
    )
    export.add_argument(
        "--adapter",
        help="PEFT adapter dir, keel output dir of a LoRA run, or checkpoints/step-N dir "
        "to merge into --model",
    )
    export.add_argument("--out", help="folder to write; must not exist or be empty")
    export.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="bfloat16, float16 or float32 (default: the base model's)",
    )
    _add_folder_flags(export)
    export.add_argument(
        "--quantize",
        nargs="?",
        const="trained",
        metavar="SCHEME",
        help="write the decoder's linear weights as torchao's quantized tensors: alone, with "
        "the scheme a QAT run (method.qat) trained for; or int8-int4, int4 or fp8",
    )


def _add_expand(sub) -> None:
    expand = sub.add_parser(
        "expand",
        help="LLaMA Pro's block expansion: write the model with new, zero-output decoder blocks",
    )
    expand.add_argument(
        "--model", required=True, help="HF model dir, Hugging Face Hub id, or bundled:NAME"
    )
    expand.add_argument(
        "--blocks",
        type=int,
        required=True,
        help="new blocks: one after each of this many equal groups of decoder layers",
    )
    expand.add_argument("--out", required=True, help="folder to write; must not exist or be empty")
    _add_folder_flags(expand)


def _add_folder_flags(parser) -> None:
    """The flags of a command that writes a model folder (keel export, keel expand)."""
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB or 2GiB (default 5GB)",
    )
    parser.add_argument(
        "--cache-dir", default="~/.cache/keel", help="where bundled models are converted"
    )


def _refuse_uneven_groups(cfg, world_size: int) -> None:
    """Context- or tensor-parallel groups that do not divide the processes: refused before a
    worker starts or anything is read (KeelError, exit 2)."""
    from keel.distributed.parallel_dims import data_parallel_size

    d = cfg.distributed
    data_parallel_size(world_size, d.context_parallel, d.tensor_parallel)


def _train(args) -> int:
    from keel.config import load_config
    from keel.distributed.launch import LaunchSpec, detect_world, launch, needs_launch

    spec = LaunchSpec.from_flags(args)
    must_launch = needs_launch(detect_world(os.environ), spec)
    if args.force:  # an override, so the workers get it too
        args.overrides = [*args.overrides, "distributed.plan=warn"]
    # Loaded in the launcher too, so a bad config fails once, before any worker starts.
    cfg = load_config(
        args.config, args.overrides, on_translation=show_translation(args.config, say)
    )
    world = spec.workers_per_node * spec.nnodes if must_launch else detect_world(os.environ)
    _refuse_uneven_groups(cfg, world if must_launch else world.world_size)
    if must_launch:
        passed = [f for f, on in (("--debug", args.debug), ("--verbose", args.verbose)) if on]
        worker_args = [*passed, "train", args.config, *args.overrides]
        return launch(spec, worker_args=worker_args)
    quiet_libraries(data=True, verbose=args.verbose)
    from keel.train.run import run_training

    run_training(cfg, base_dir=Path.cwd(), log=say, verbose=args.verbose)
    return 0


def _validate(args) -> int:
    from keel.config import load_config
    from keel.train.preflight import preflight

    cfg = load_config(
        args.config, args.overrides, on_translation=show_translation(args.config, print)
    )
    if args.nproc < 1 or args.nnodes < 1:
        raise ConfigError(
            [f"--nproc and --nnodes must be at least 1 ({args.nproc}, {args.nnodes})"]
        )
    checked = preflight(cfg, base_dir=Path.cwd(), source=args.config)
    for line in checked.summary(processes=args.nproc * args.nnodes):
        print(line)
    print(f"{args.config}: config and data are valid")
    return 0


def _chat(args) -> int:
    from keel.infer.chat import chat_images, chat_once, interactive_chat
    from keel.models import load_for_inference

    fill_from_their_config(args, "chat")
    model, tokenizer = load_for_inference(args.model, args.adapter, cache_dir=args.cache_dir)
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    if args.image:
        gen["images"] = chat_images(model, args.image, base_dir=Path.cwd())
    if args.prompt is not None:
        chat_once(model, tokenizer, args.prompt, system=args.system, **gen)
    else:
        interactive_chat(model, tokenizer, system=args.system, **gen)
    return 0


def _plan(args) -> int:
    import json

    import torch

    from keel.config import load_config
    from keel.plan import advice, detect_devices, plan_run, summary, table, to_json
    from keel.precision import resolve_precision

    cfg = load_config(args.config, args.overrides)
    devices = detect_devices(
        gpus=args.gpus,
        nodes=args.nodes,
        memory=args.gpu_memory,
        config_memory=cfg.distributed.device_memory,
    )
    precision = None  # on a GPU, plan_run resolves auto itself (bf16)
    if devices.kind == "cpu":  # auto on a CPU measures it, as training does
        precision = resolve_precision(cfg.train.precision, torch.device("cpu"))
    plan = plan_run(
        cfg,
        devices=devices,
        precision=precision,
        log=lambda message: print(message, file=sys.stderr),
    )
    if args.json:
        print(json.dumps(to_json(plan), indent=1))
    else:
        print("\n".join([summary(plan), table(plan), *advice(plan)]))
    return 0


def _doctor(args) -> int:
    from keel.doctor import run_doctor
    from keel.precision import cpu_bf16_speedup

    # The CPU's bf16 is measured by the same probe `precision: auto` uses.
    return run_doctor(as_json=args.json, cpu_bf16_speedup=cpu_bf16_speedup)


def _export(args) -> int:
    from keel.export import ExportRequest, export_model

    fill_from_their_config(args, "export")
    request = ExportRequest(
        model=args.model,
        adapter=args.adapter,
        out=Path(args.out),
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        cache_dir=args.cache_dir,
        quantize=args.quantize,
    )
    export_model(request)
    return 0


def _expand(args) -> int:
    from keel.export.expand import ExpandRequest, expand_model
    from keel.export.write import DEFAULT_MAX_SHARD_SIZE

    request = ExpandRequest(
        model=args.model,
        blocks=args.blocks,
        out=Path(args.out),
        max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        cache_dir=args.cache_dir,
    )
    expand_model(request)
    return 0


COMMANDS = {
    "train": _train,
    "validate": _validate,
    "chat": _chat,
    "plan": _plan,
    "doctor": _doctor,
    "export": _export,
    "expand": _expand,
    "predict": run_predict,
    "serve": run_serve,
    "convert": run_convert,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse keel's command line; `key=value` overrides may also follow the flags.

    argparse alone rejects `keel train cfg.yaml --nproc 8 train.lr=1e-4`: it fills the
    `overrides` positional before it sees the flags. Leftover words are overrides.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if (
        extra
        and getattr(args, "overrides", None) is not None
        and not any(word.startswith("-") for word in extra)
    ):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one keel command; returns its exit code (tests and embedding programs call this)."""
    return _run(parse_args(argv))


def entry() -> NoReturn:
    """The `keel` program (console script and `python -m keel`): main, then exit.

    A `keel train` or `keel predict` worker that torchrun or srun started ends without
    interpreter teardown: its gloo threads may outlive the process group (see
    keel.distributed.process_group.exit_now). Only the program does this, never `main`,
    which a test or another program may call in its own process."""
    args = parse_args()
    if not _launched_worker(args):
        raise SystemExit(_run(args))
    from keel.distributed.process_group import exit_now

    try:
        code = _run(args)
    except BaseException:  # what Python would print at exit, then its exit status
        traceback.print_exc()
        code = 1
    exit_now(code)


def _run(args) -> int:
    # peft calls a transformers API that transformers 5 deprecates; users cannot act on it.
    warnings.filterwarnings(
        "ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning
    )
    # doctor imports neither library; train quiets them only where it trains (a launcher
    # of --nproc workers need not import them)
    if args.command not in ("doctor", "train"):
        quiet_libraries(data=args.command in ("validate", "predict"), verbose=args.verbose)
    try:
        return COMMANDS[args.command](args)
    except KeelError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _launched_worker(args) -> bool:
    """`keel train` or `keel predict` in a process that torchrun or srun started as one rank."""
    from keel.distributed.launch import detect_world

    if args.command not in ("train", "predict"):
        return False
    try:
        return detect_world(os.environ).is_distributed
    except KeelError:  # malformed launcher variables: the command reports them
        return False


if __name__ == "__main__":
    entry()
