"""`--backend vllm`: the same routes, with generation handed to vLLM's engine on a GPU.

`VllmEngine` offers what the routes use of `Engine` (submit, cancel, adapters, stats) and
drives `vllm.LLMEngine` from one thread the same way: add requests, step, send text.
Each of a job's `n` choices is its own vLLM request (seed + i, as in keel's engine).
Only this module imports vLLM, and only after `require_vllm` found it and a CUDA GPU.
"""

from __future__ import annotations

import importlib.util
import json
import uuid
from concurrent.futures import Future
from pathlib import Path

from keel.errors import KeelError, ModelError
from keel.infer.serve.adapter_files import AdapterCaps, inspect_adapter
from keel.infer.serve.scheduler import Delta, Done, Failed, Job, SchedulerThread


def require_vllm() -> None:
    """KeelError (exit 2) unless vLLM is installed and a CUDA GPU is visible."""
    if importlib.util.find_spec("vllm") is None:
        raise KeelError(
            "--backend vllm: vLLM is not installed. Install it on a machine with a CUDA GPU "
            "(pip install vllm), or drop --backend to use keel's own engine."
        )
    import torch

    if not torch.cuda.is_available():
        raise KeelError(
            "--backend vllm needs a CUDA GPU and none is visible here; "
            "drop --backend to use keel's own engine (CPU or GPU)."
        )


def build_vllm_state(options, adapters: list[tuple[str, str]], log):
    """The routes' `ServeState` around a vLLM engine for `options.model`."""
    require_vllm()
    from vllm import EngineArgs, LLMEngine

    from keel.infer.serve.app import ServeState
    from keel.infer.serve.server import adapter_root
    from keel.models import load_tokenizer, resolve_model_path

    model_dir, revision, own_adapter = _model_dir(options)
    base_dir = resolve_model_path(model_dir, options.cache_dir, log, revision=revision)
    if own_adapter is not None:
        adapters = [(options.model, own_adapter), *adapters]
    ranks = [_rank(path) for _, path in adapters]
    args = EngineArgs(
        model=str(base_dir),
        max_num_seqs=options.limits.max_batch_size,
        enable_lora=True,  # so adapters can also be loaded later, over HTTP
        max_lora_rank=_rank_bucket(max([16, *ranks])),
        max_loras=max(1, len(adapters)),
    )
    log(f"starting vLLM on {base_dir}")
    base_name = model_dir if own_adapter is not None else options.model
    engine = VllmEngine(LLMEngine.from_engine_args(args), base_name, options.limits.adapter_caps())
    for name, path in adapters:
        engine.adapters.add(name, path)
    return ServeState(
        engine=engine,
        tokenizer=load_tokenizer(base_dir),
        limits=options.limits,
        default_model=options.model,
        api_key=options.api_key,
        adapter_root=adapter_root(options),
    )


def _model_dir(options) -> tuple[str, str, str | None]:
    # A keel LoRA output dir is served as its base (at the revision it names) plus that adapter.
    config = Path(options.model).expanduser() / "adapter_config.json"
    if options.model.startswith("bundled:") or not config.is_file():
        return options.model, "main", None
    recorded = json.loads(config.read_text())
    base = recorded.get("base_model_name_or_path")
    if not base:
        raise ModelError(f"{config} names no base model; pass --model BASE --adapter NAME=PATH")
    return base, recorded.get("revision") or "main", options.model


def _rank(path: str) -> int:
    config = Path(path).expanduser() / "adapter_config.json"
    if not config.is_file():
        raise ModelError(f"adapter {path}: no adapter_config.json there; give a LoRA adapter dir")
    return int(json.loads(config.read_text()).get("r", 16))


def _rank_bucket(rank: int) -> int:
    bucket = 8
    while bucket < rank:
        bucket *= 2
    return bucket


class VllmAdapters:
    """Served names -> vLLM LoRA requests (vLLM loads each on first use)."""

    def __init__(self, base_name: str, caps: AdapterCaps):
        self.base_name = base_name
        self.caps = caps
        self.requests: dict[str, object] = {}
        self._next_id = 1

    def names(self) -> list[str]:
        return [self.base_name, *self.requests]

    def add(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if name == self.base_name or name in self.requests:
            raise ModelError(f"a model named {name!r} is already served; pick another name")
        if len(self.requests) >= self.caps.max_adapters:
            raise ModelError(
                f"this server holds at most {self.caps.max_adapters} adapters (--max-adapters); "
                "unload one first"
            )
        # safetensors only, rank and size capped
        shapes = inspect_adapter(name, path, self.caps)
        whole = shapes.in_full
        if shapes.dora:
            raise ModelError(
                f"adapter {name!r} is a DoRA adapter, which vLLM's LoRA does not run; merge "
                "it into its base (keel export) and serve that, or serve it with --backend keel"
            )
        if whole:
            raise ModelError(
                f"adapter {name!r} trains {', '.join(whole)} in full (PEFT modules_to_save), "
                "which vLLM's LoRA does not run; merge it into its base (keel train with "
                "output.merge_lora) and serve that, or serve it with --backend keel"
            )
        self.requests[name] = LoRARequest(name, self._next_id, str(Path(path).expanduser()))
        self._next_id += 1


class VllmEngine(SchedulerThread):
    """The keel engine's interface over `vllm.LLMEngine`, driven by one thread."""

    def __init__(self, llm, base_name: str, caps: AdapterCaps):
        super().__init__(name="keel-vllm")
        self.llm = llm
        self.adapters = VllmAdapters(base_name, caps)
        self.context_length = llm.model_config.max_model_len
        self._live: dict[str, tuple[Job, int]] = {}  # vLLM request id -> (job, choice index)
        self._sent: dict[str, int] = {}  # characters of text already sent per request

    def load_adapter(self, name: str, path: str) -> Future:
        return self.call(lambda: self.adapters.add(name, path))

    def unload_adapter(self, name: str) -> Future:
        def unload() -> None:
            request = self.adapters.requests.pop(name)
            users = [rid for rid, (job, _) in self._live.items() if job.model == name]
            self._end(users, f"adapter {name!r} was unloaded while this request ran")
            self.llm.remove_lora(request.lora_int_id)

        return self.call(unload)

    def _busy(self) -> bool:
        return bool(self._live)

    def _shutdown(self, message: str) -> None:
        self._end(list(self._live), message)

    def step(self) -> bool:
        """Add new jobs, drop cancelled ones, run one vLLM step, send the new text."""
        for job in self._take():
            self._add(job)
        self._end([rid for rid, (job, _) in self._live.items() if job.cancelled], None)
        if self._live:
            self._step()
        return self._busy()

    def _add(self, job: Job) -> None:
        from vllm import SamplingParams

        lora = self.adapters.requests.get(job.model)
        if lora is None and job.model != self.adapters.base_name:
            job.sink(Failed(f"model {job.model!r} is no longer served"))
            return
        p = job.params
        for i in range(job.n):
            params = SamplingParams(
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                stop=list(p.stop) or None,
                seed=None if p.seed is None else p.seed + i,
            )
            rid = uuid.uuid4().hex
            self.llm.add_request(
                rid, {"prompt_token_ids": job.prompt_ids}, params, lora_request=lora
            )
            self._live[rid], self._sent[rid] = (job, job.first_index + i), 0

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as e:
            self._end(list(self._live), f"generation failed: {type(e).__name__}: {e}")
            return
        self.stats.steps += 1
        self.stats.running = len(self._live)
        for out in outputs:
            if out.request_id not in self._live:
                continue
            job, index = self._live[out.request_id]
            completion = out.outputs[0]
            piece = completion.text[self._sent[out.request_id] :]
            self._sent[out.request_id] = len(completion.text)
            if piece:
                job.sink(Delta(index, piece))
            if out.finished:
                tokens = len(completion.token_ids)
                self.stats.generated_tokens += tokens
                job.sink(Done(index, completion.finish_reason or "stop", tokens))
                del self._live[out.request_id], self._sent[out.request_id]

    def _end(self, request_ids: list[str], message: str | None) -> None:
        if not request_ids:
            return
        self.llm.abort_request(request_ids)
        told = set()
        for rid in request_ids:
            job, _ = self._live.pop(rid)
            self._sent.pop(rid, None)
            job.cancelled = True
            if message is not None and id(job) not in told:
                told.add(id(job))
                job.sink(Failed(message))
