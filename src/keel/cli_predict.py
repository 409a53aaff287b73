"""`keel predict`: answer a dataset's prompts and score the answers (split from cli.py,
which registers and calls these; like cli.py: parse, then call, no logic of its own)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from keel.cli_their import add_their_config, fill_from_their_config
from keel.console import say
from keel.errors import ConfigError


def add_predict(sub) -> None:
    predict = sub.add_parser(
        "predict",
        help="answer every prompt of a dataset; write the answers and their BLEU-4, ROUGE "
        "and exact match against the dataset's answers",
    )
    add_their_config(predict)
    predict.add_argument(
        "--model",
        help="HF model dir, Hugging Face Hub id (owner/name), keel output dir, or bundled:NAME",
    )
    predict.add_argument("--adapter", help="a PEFT adapter dir to apply on top of --model")
    predict.add_argument(
        "--data",
        action="append",
        metavar="PATH",
        help="rows to answer (repeatable): a file, folder, Hub dataset or dataset_info.json "
        "name, as data.datasets takes; each row ends with the answer it is scored against",
    )
    predict.add_argument(
        "--dataset-dir", help="folder of a LLaMA-Factory dataset_info.json (for names)"
    )
    predict.add_argument("--out", help="folder to write; must not exist or be empty")
    predict.add_argument("--template", help="chat template, as data.template (default auto)")
    predict.add_argument("--cutoff-len", type=int, help="longest prompt in tokens (default 1024)")
    predict.add_argument("--max-samples", type=int, help="the first N rows of each dataset")
    predict.add_argument(
        "--skip-long", action="store_true", help="skip prompts over --cutoff-len (else an error)"
    )
    predict.add_argument(
        "--skip-invalid", action="store_true", help="skip rows that are not valid (else an error)"
    )
    predict.add_argument("--system", help="system prompt for rows without one")
    predict.add_argument("--max-new-tokens", type=int, help="default 512")
    predict.add_argument("--temperature", type=float, help="0 (the default) means greedy")
    predict.add_argument("--top-p", type=float, help="default 1")
    predict.add_argument("--seed", type=int, help="row i samples with seed + i (default 42)")
    predict.add_argument(
        "--max-batch-size", type=int, help="sequences decoded together (default 16)"
    )
    predict.add_argument(
        "--cache-dir", default="~/.cache/keel", help="where bundled models are converted"
    )
    predict.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="N worker processes on this node via torchrun (one per GPU), each answering "
        "every N-th row; default: one process",
    )
    predict.set_defaults(run_data=None)


# predict's flags as a worker gets them again: (argparse name, flag), valued then switches
_VALUED = (
    *(("model", "--model"), ("adapter", "--adapter"), ("dataset_dir", "--dataset-dir")),
    *(("out", "--out"), ("template", "--template"), ("cutoff_len", "--cutoff-len")),
    *(("max_samples", "--max-samples"), ("system", "--system")),
    *(("max_new_tokens", "--max-new-tokens"), ("temperature", "--temperature")),
    *(("top_p", "--top-p"), ("seed", "--seed"), ("max_batch_size", "--max-batch-size")),
    ("cache_dir", "--cache-dir"),
)
_SWITCHES = (("skip_long", "--skip-long"), ("skip_invalid", "--skip-invalid"))


def run_predict(args) -> int:
    """One process answers (on its GPU, if any); --nproc N starts N workers via torchrun,
    after the flags, the config and the output folder are checked here once."""
    import contextlib
    import io
    import os

    from keel.distributed.launch import LaunchSpec, detect_world, launch, needs_launch
    from keel.export.write import check_out

    worker_args = _worker_args(args)
    world = detect_world(os.environ)
    if world.is_distributed and not world.is_main:  # the mapping report: rank 0 prints it
        with contextlib.redirect_stderr(io.StringIO()):
            request = _request(args)
    else:
        request = _request(args)
    spec = LaunchSpec(nproc=args.nproc)
    if needs_launch(world, spec):
        check_out(request.out.expanduser())
        return launch(spec, worker_args=worker_args, log=say)
    return _answer(request, world)


def _answer(request, world) -> int:
    from keel.distributed.process_group import join_world, shutdown
    from keel.infer.predict import predict

    dist = None
    if world.is_distributed:  # torchrun's workers (--nproc), or srun's tasks
        dist = join_world(
            world,
            timeout_s=600.0,
            preprocess_timeout_s=86400.0,  # a process answering longer rows waits this long
            log=say,
        )
    try:
        predict(request, base_dir=Path.cwd(), log=say, dist=dist)
    finally:
        if dist is not None:
            shutdown(dist)
    return 0


def _worker_args(args) -> list[str]:
    """The command a worker runs: predict with the flags given, --nproc left out."""
    words = [f for f, on in (("--debug", args.debug), ("--verbose", args.verbose)) if on]
    words += ["predict", *([args.config] if args.config else []), *args.overrides]
    for name, flag in _VALUED:
        if getattr(args, name) is not None:
            words += [flag, str(getattr(args, name))]
    for path in args.data or ():
        words += ["--data", path]
    return words + [flag for name, flag in _SWITCHES if getattr(args, name)]


def _request(args):
    from keel.infer.predict import Answering, PredictRequest

    fill_from_their_config(args, "predict")
    _check_answering(args)
    return PredictRequest(
        model=args.model,
        adapter=args.adapter,
        data=_data_config(args),
        out=Path(args.out),
        answering=Answering(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            max_batch_size=args.max_batch_size,
            system=args.system,
        ),
        cache_dir=args.cache_dir,
    )


def _check_answering(args) -> None:
    problems = [
        f"{flag} {value}: {rule}"
        for flag, value, ok, rule in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "at least 1"),
            ("--max-batch-size", args.max_batch_size, args.max_batch_size >= 1, "at least 1"),
            ("--temperature", args.temperature, args.temperature >= 0, "0 (greedy) or more"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
        )
        if not ok
    ]
    if problems:
        raise ConfigError(problems, source=args.config)


def _data_config(args):
    """The rows to answer: --data, else the evaluation data of the config given."""
    from keel.config.load import load_section
    from keel.config.schema import DataConfig

    if args.data:
        datasets = [d if isinstance(d, dict) else {"path": d} for d in args.data]
        data = load_section(DataConfig, {"datasets": datasets}, "data.", "--data")
        if args.run_data is not None:  # keel's run config: its template and limits
            data = dataclasses.replace(args.run_data, datasets=data.datasets)
    elif args.run_data is not None and args.run_data.datasets:
        data = args.run_data
    else:
        whose = f"{args.config} has no data.eval_datasets" if args.run_data else "no rows given"
        raise ConfigError(
            [f"keel predict needs --data (the rows to answer): {whose}"], source=args.config
        )
    given = {
        "dataset_dir": args.dataset_dir,
        "template": args.template,
        "cutoff_len": args.cutoff_len,
        "on_invalid": "skip" if args.skip_invalid else None,
        "overlength": "drop" if args.skip_long else None,
    }
    data = dataclasses.replace(data, **{k: v for k, v in given.items() if v is not None})
    if args.max_samples is not None:
        if args.max_samples < 1:
            raise ConfigError([f"--max-samples {args.max_samples}: give at least 1"])
        limited = [dataclasses.replace(d, max_samples=args.max_samples) for d in data.datasets]
        data = dataclasses.replace(data, datasets=limited)
    if data.cutoff_len < 1:
        raise ConfigError([f"--cutoff-len {data.cutoff_len}: give at least 1"])
    return data
