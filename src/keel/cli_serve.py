"""`keel serve`'s flags and how they become ServeOptions (split from cli.py, which calls these;
like cli.py: parse, then call, no logic)."""

from __future__ import annotations

import argparse

from keel.cli_their import add_their_config, fill_from_their_config


def add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (continuous batching, LoRA adapters) and a web chat",
    )
    add_their_config(serve)
    serve.add_argument(
        "--model",
        help="HF model dir, Hugging Face Hub id (owner/name), keel output dir, "
        "or bundled:smollm2-135m-instruct",
    )
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA adapter at PATH as model NAME (repeatable)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)"
    )
    serve.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port")
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require the header Authorization: Bearer KEY on /v1 routes",
    )
    _add_serve_engine(serve)


def _add_serve_engine(serve) -> None:
    """How `keel serve` decodes, and the limits on what one request or adapter may ask."""
    serve.add_argument(
        "--max-batch-size",
        type=int,
        default=16,
        metavar="N",
        help="sequences decoded together (default 16)",
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        metavar="N",
        help="requests in flight, running or queued; more get HTTP 429 (default 64)",
    )
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="largest max_tokens a request may ask for (default 2048)",
    )
    serve.add_argument(
        "--backend",
        choices=["keel", "vllm"],
        help="keel (default, any device) or vllm (needs vLLM and a CUDA GPU)",
    )
    serve.add_argument(
        "--cache-dir", default="~/.cache/keel", help="where bundled models are converted"
    )
    serve.add_argument(
        "--adapter-root",
        metavar="DIR",
        help="let clients load LoRA adapters over HTTP from inside DIR (default: off)",
    )
    for flag, default, what in (
        ("--max-prompts", 16, "prompts in one /v1/completions request"),
        ("--max-prompt-tokens", 8192, "tokens in one prompt"),
        ("--max-prefill-tokens", 512, "prompt tokens prefilled per step; longer ones in chunks"),
        ("--max-adapters", 8, "LoRA adapters served at once"),
        ("--max-lora-rank", 256, "largest LoRA rank an adapter may have"),
        ("--max-images", 4, "images in one chat request (vision-language models)"),
        ("--max-image-pixels", 4096 * 4096, "pixels in one request image"),
    ):
        serve.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} ({default})")
    _add_serve_sizes(serve)


def _add_serve_sizes(serve) -> None:
    """Size limits on what a request may send, and where it may read files from."""
    serve.add_argument(
        "--max-adapter-size",
        type=parse_size,
        default="1GiB",
        metavar="SIZE",
        help="largest adapter_model.safetensors to load (default 1GiB)",
    )
    serve.add_argument(
        "--max-image-size",
        type=parse_size,
        default="8MiB",
        metavar="SIZE",
        help="largest image (encoded bytes) a chat request may send (default 8MiB)",
    )
    serve.add_argument(
        "--image-root",
        metavar="DIR",
        help="let chat requests name image files (paths, file:// URLs) inside DIR "
        "(default: data: URLs only)",
    )


def parse_size(text: str) -> int:
    """An argparse type for sizes such as 5GB or 2GiB (bytes)."""
    from keel.config.sizes import parse_memory

    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_serve(args) -> int:
    """`keel serve`: the parsed flags as ServeOptions, then serve until interrupted."""
    from keel.infer.serve.limits import ServeLimits
    from keel.infer.serve.server import ServeOptions, run_server

    fill_from_their_config(args, "serve")
    limits = ServeLimits(
        max_batch_size=args.max_batch_size,
        max_concurrency=args.max_concurrency,
        max_tokens=args.max_tokens,
        max_prompts=args.max_prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        max_adapters=args.max_adapters,
        max_lora_rank=args.max_lora_rank,
        max_adapter_bytes=args.max_adapter_size,
        max_images=args.max_images,
        max_image_bytes=args.max_image_size,
        max_image_pixels=args.max_image_pixels,
    )
    options = ServeOptions(
        model=args.model,
        adapters=tuple(args.adapter),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        limits=limits,
        backend=args.backend,
        cache_dir=args.cache_dir,
        adapter_root=args.adapter_root,
        image_root=args.image_root,
    )
    return run_server(options)
