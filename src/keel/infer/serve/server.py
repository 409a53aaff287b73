"""Load the model and adapters, build the engine and app, and run uvicorn (`keel serve`)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from keel.errors import KeelError, ModelError
from keel.extras import require_extra
from keel.infer.serve.limits import ServeLimits

Log = Callable[[str], None]
BACKENDS = ("keel", "vllm")


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """Everything `keel serve` was asked for, as given on the command line."""

    model: str
    adapters: tuple[str, ...] = ()  # "NAME=PATH" each
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    limits: ServeLimits = field(default_factory=ServeLimits)
    backend: str = "keel"
    cache_dir: str = "~/.cache/keel"
    # Clients may load adapters over HTTP only from inside this folder; None: not at all.
    adapter_root: str | None = None
    # Chat requests may name image files only inside this folder; None: data: URLs only.
    image_root: str | None = None


def check_options(options: ServeOptions) -> list[tuple[str, str]]:
    """Every problem with the options (all at once), and the adapters as (name, path)."""
    problems = list(options.limits.problems())
    if options.backend not in BACKENDS:
        problems.append(f"--backend {options.backend}: use one of {', '.join(BACKENDS)}")
    if not 0 <= options.port <= 65535:
        problems.append(f"--port {options.port}: must be 0..65535")
    for flag, root, what in (
        ("--adapter-root", options.adapter_root, "adapters"),
        ("--image-root", options.image_root, "images"),
    ):
        if root is not None and not Path(root).expanduser().is_dir():
            problems.append(f"{flag} {root}: not a folder; give the folder {what} live in")
    adapters = []
    for spec in options.adapters:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            problems.append(f"--adapter {spec}: write it as NAME=PATH, e.g. support=outputs/lora")
        else:
            adapters.append((name.strip(), path.strip()))
    names = [name for name, _ in adapters]
    problems += [f"--adapter {n}: the name is used twice" for n in set(names) if names.count(n) > 1]
    if problems:
        raise KeelError("keel serve cannot start:\n" + "\n".join(f"  - {p}" for p in problems))
    return adapters


def build_state(options: ServeOptions, log: Log = print):
    """Load everything `options` names and return the routes' shared `ServeState`."""
    adapters = check_options(options)
    _check_web_stack()
    if options.backend == "vllm":
        from keel.infer.serve.vllm_backend import build_vllm_state

        return build_vllm_state(options, adapters, log)
    return _build_keel_state(options, adapters, log)


def _build_keel_state(options: ServeOptions, adapters: list[tuple[str, str]], log: Log):
    import torch

    from keel.infer.serve.adapters import AdapterSet
    from keel.infer.serve.app import ServeState
    from keel.infer.serve.engine import Engine
    from keel.infer.vision import vision_of
    from keel.models import load_for_inference

    model, tokenizer = load_for_inference(options.model, None, cache_dir=options.cache_dir, log=log)
    if torch.cuda.is_available():
        model = model.to("cuda")
    _check_cache_layout(model.config)
    unbatched = _unbatched_kind(model)
    if unbatched:  # PEFT's mixed batches take no DoRA or OFT rows: serve it merged, alone
        log(f"{options.model} is {unbatched}: served merged into its base, without the base")
        model = model.merge_and_unload()
        if adapters:
            raise ModelError(
                f"--model {options.model} is {unbatched}, served merged into its base, so "
                f"adapters of that base cannot be served beside it; serve them from a server "
                f"of the base model"
            )
    if hasattr(model, "peft_config"):  # --model is a keel output dir holding an adapter
        base_name = model.peft_config["default"].base_model_name_or_path
        served = AdapterSet(model, base_name, options.limits.adapter_caps())
        served.adopt(options.model, "default")
    else:
        served = AdapterSet(model, options.model, options.limits.adapter_caps())
    for name, path in adapters:
        log(f"loading adapter {name} from {path}")
        served.load(name, path)
    engine = Engine(
        served,
        tokenizer,
        max_batch_size=options.limits.max_batch_size,
        max_prefill_tokens=options.limits.max_prefill_tokens,
    )
    return ServeState(
        engine=engine,
        tokenizer=tokenizer,
        limits=options.limits,
        default_model=options.model,
        api_key=options.api_key,
        adapter_root=adapter_root(options),
        vision=vision_of(model, log),
        image_root=_resolved(options.image_root),
    )


def _unbatched_kind(model) -> str:
    """'a DoRA adapter' or 'an OFT adapter' when `model` is a PEFT model whose adapter PEFT
    cannot run per row of a mixed batch; '' otherwise."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return ""
    if getattr(config, "use_dora", False):
        return "a DoRA adapter"
    kind = getattr(config.peft_type, "value", str(config.peft_type))
    return "" if kind == "LORA" else f"an {kind} adapter"


def adapter_root(options: ServeOptions) -> Path | None:
    """The folder adapters may be loaded from over HTTP (symlinks resolved), or None."""
    return _resolved(options.adapter_root)


def _resolved(root: str | None) -> Path | None:
    """A --adapter-root / --image-root folder with symlinks resolved, or None."""
    if root is None:
        return None
    return Path(root).expanduser().resolve()


def _check_cache_layout(config) -> None:
    # The engine keeps one KV column per position in every layer; recurrent or
    # linear-attention layers keep no such cache.
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None) or []
    odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if odd:
        raise ModelError(
            f"keel serve batches attention-only models; this one has {', '.join(odd)} layers. "
            "Use --backend vllm on a GPU, or `keel chat` for one conversation at a time."
        )


def _check_web_stack() -> None:
    require_extra("serve", "keel serve")


def _say(message: str) -> None:
    print(message, flush=True)  # at once, also when stdout is a pipe (logs, tests)


def run_server(options: ServeOptions, log: Log = _say) -> int:
    """Serve until interrupted; returns the exit code."""
    check_options(options)
    _check_web_stack()  # before the imports below and before the model loads
    import uvicorn

    from keel.infer.serve.app import create_app

    if options.api_key is None and not _is_loopback(options.host):
        log(
            f"warning: --host {options.host} accepts connections from other machines and no "
            "--api-key is set: anyone who can reach this port can use the model"
        )
    state = build_state(options, log)
    app = create_app(state)
    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    log(f"keel serve: {', '.join(state.engine.adapters.names())} on http://{host}:{port}/")
    server = uvicorn.Server(uvicorn.Config(app, log_level="info"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn passes Ctrl-C on after its graceful shutdown: a normal stop
    log("keel serve: stopped")
    return 0


class BackgroundServer:
    """Serve `state` from a thread of this process: `with BackgroundServer(state) as url:`.

    For tests, benchmarks and notebooks; port 0 picks a free port. Leaving the block
    stops the server and its engine.
    """

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0):
        self.state = state
        self.host = host
        self.port = port
        self._server = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> str:
        import uvicorn

        from keel.infer.serve.app import create_app

        sock = bind(self.host, self.port)
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(create_app(self.state), log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="keel-serve", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.02)
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port); KeelError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KeelError(
            f"cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host"
        ) from e
    sock.listen(2048)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
