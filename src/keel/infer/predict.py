"""`keel predict`: answer every prompt of a dataset with a model, and score the answers
against the dataset's own (LLaMA-Factory's `do_predict` with `predict_with_generate`).

Each row is a conversation that ends with the assistant's answer, in any format keel trains
on (messages, sharegpt, alpaca; files, folders, Hub datasets, dataset_info.json names). The
conversation before the last answer is the prompt, rendered with the chat template and its
generation prompt as training renders it; the last answer is the label. A row without an
answer (grpo's prompts) is answered and not scored. A row with images needs a
vision-language model, and is rendered with the model's own template. The prompts
are answered by the engine `keel serve` runs (continuous batching); row i samples with seed
`seed + i`, so its answer does not depend on the rows decoded beside it, nor on how many
processes share the rows.

The output folder gets `generated_predictions.jsonl` (one line per row, in order: prompt,
predict, label, as theirs, plus finish_reason and source) and `predict_results.json` (the
scores of keel.infer.text_metrics, as predict_<name>, and the timings). The folder is
written whole at the end, or not at all; one that is not empty is refused before anything
loads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from keel.config.schema import DataConfig
from keel.data.formats import RowError, detect_format, without_system
from keel.data.report import Rejection, list_capped
from keel.errors import DataError, ImageError

Log = Callable[[str], None]
PREDICTIONS = "generated_predictions.jsonl"
RESULTS = "predict_results.json"


@dataclass(frozen=True, kw_only=True)
class Answering:
    """How the answers are generated."""

    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 42  # row i samples with seed + i
    max_batch_size: int = 16  # sequences decoded together
    system: str | None = None  # a system prompt for rows without one


@dataclass(frozen=True, kw_only=True)
class PredictRequest:
    model: str  # as keel chat's --model
    adapter: str | None
    data: DataConfig  # data.datasets: the rows; template, cutoff_len (prompt tokens), overlength
    out: Path  # must not exist or be empty
    answering: Answering
    cache_dir: str = "~/.cache/keel"


@dataclass(frozen=True)
class _Prompt:
    where: str  # file and row
    ids: list[int]
    text: str  # the rendered prompt (images as their placeholders)
    label: str | None  # None: a prompt alone, answered but not scored
    # a row with images: (messages, image references, their folder), encoded again when
    # its chunk is answered, so that a large dataset's pixels are never all in memory
    images: tuple | None = None

    def image_prompt(self, reader: _Reader):
        """The keel.infer.vision.ImagePrompt the model answers; None for a text row."""
        return None if self.images is None else _encode_images(reader, *self.images)


@dataclass(frozen=True)
class _Reader:
    """What turns rows into prompts: the tokenizer, template and the model's vision."""

    tokenizer: object
    template: object  # keel.data.template.ChatTemplate
    vision: object | None
    system: str | None
    context: int  # the longest sequence the model's positions allow (prompt and answer)


def predict(request: PredictRequest, *, base_dir: Path, log: Log = print, dist=None) -> Path:
    """Answer every row of `request.data.datasets`; write request.out; return it.

    `dist` (keel.distributed.process_group.DistContext; None: this process alone, on its
    GPU if it has one): each of its processes answers every world_size-th row on its own
    device, with the same per-row seeds, and the first gathers the answers and writes. Each
    keeps what it answered on disk as it goes (keel.infer.predict_progress), so the same
    command after an interruption answers only the rest."""
    from keel.distributed.process_group import DistContext, choose_device, main_rank_first, on_main
    from keel.export.write import check_out

    dist = dist if dist is not None else DistContext(device=choose_device(0))
    say = log if dist.is_main else _quiet
    out = check_out(Path(request.out).expanduser())
    model, reader = _load(request, dist.device, base_dir, say)
    folders = (Path(base_dir), Path(request.cache_dir).expanduser())
    with main_rank_first(dist):  # the first reads (and caches) the data; then the others
        prompts = read_prompts(request, reader, folders=folders, log=say)
    started = time.perf_counter()
    share = list(range(dist.rank, len(prompts), dist.world_size))
    if dist.world_size > 1:
        n = dist.world_size
        say(f"predict: {n} processes; process r answers rows r, r + {n}, r + {2 * n}, ...")
    progress = _progress(model, request, [(i, prompts[i]) for i in share], (dist, out), say)
    todo = [(i, prompts[i]) for i in share if i not in progress.answers]
    _generate(model, reader, todo, request.answering, (progress.add, say))
    mine = [(i, progress.answers[i]) for i in share]
    gathered = dist.gather_objects(mine, slow=True)  # waits for the slowest

    def write() -> None:
        ordered = sorted((pair for part in gathered for pair in part), key=lambda p: p[0])
        answers = [answer for _, answer in ordered]
        seconds = time.perf_counter() - started
        run = (seconds, dist.world_size)
        _write_out(request, out, (prompts, answers, reader.tokenizer), run, log)

    on_main(dist, write)  # a failure there stops every process, each keeping its progress
    progress.remove()
    return out


def _load(request: PredictRequest, device, base_dir: Path, say: Log):
    """The model on `device` (on a GPU the checkpoint's own dtype, bf16 for most; on the
    CPU fp32, as keel chat) and the _Reader of its prompts."""
    import torch

    from keel.data.template import resolve_template
    from keel.infer.serve.engine import context_length
    from keel.infer.vision import vision_of
    from keel.models import load_for_inference

    dtype = None if device.type == "cuda" else torch.float32
    model, tokenizer = load_for_inference(
        request.model, request.adapter, cache_dir=request.cache_dir, dtype=dtype, log=say
    )
    model = model.to(device)
    template, note = resolve_template(request.data.template, tokenizer, base_dir)
    if note:
        say(note)
    vision, context = vision_of(model, say), context_length(model.config)
    return model, _Reader(tokenizer, template, vision, request.answering.system, context)


def _progress(model, request: PredictRequest, share, place: tuple, say: Log):
    """This process's Progress, holding what an interrupted run of the same request answered
    (`place`: the DistContext and the output folder)."""
    import dataclasses

    from keel.infer.predict_progress import Progress, fingerprint, progress_path

    dist, out = place
    answering = dataclasses.asdict(request.answering)
    answering.pop("max_batch_size")  # how many decode together: not what each answers
    facts = {
        **{"model": request.model, "adapter": request.adapter, "answering": answering},
        **{"rank": dist.rank, "world_size": dist.world_size},
    }
    path = progress_path(out, dist.rank, dist.world_size)
    progress = Progress(path, fingerprint(model, facts, [p for _, p in share]), say)
    if kept := progress.load():
        say(f"predict: resuming: {len(kept)} of {len(share)} rows answered before ({path})")
    return progress


def _write_out(request: PredictRequest, out: Path, answered: tuple, run: tuple, log: Log):
    """The output folder, whole: `answered` (prompts, answers, tokenizer); `run` (seconds,
    processes)."""
    from keel.export.partial_folder import write_folder_atomically

    prompts, answers, tokenizer = answered
    texts = [tokenizer.decode(a.token_ids, skip_special_tokens=True) for a in answers]
    results = _results(request, (prompts, answers, texts), run)

    def write(folder: Path) -> None:
        with open(folder / PREDICTIONS, "w", encoding="utf-8") as f:
            for prompt, answer, text in zip(prompts, answers, texts):
                record = {
                    "prompt": prompt.text,
                    "predict": text,
                    "label": prompt.label,
                    "finish_reason": answer.finish_reason,
                    "source": prompt.where,
                }
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        (folder / RESULTS).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")

    write_folder_atomically(out, write, log)
    log(_summary(results, out))


def _quiet(message: str) -> None:
    """The log of every process but the first: one copy of each line is enough."""


def read_prompts(
    request: PredictRequest, reader: _Reader, *, folders: tuple[Path, Path], log: Log
) -> list[_Prompt]:
    """Every row of request.data.datasets as a prompt and its label, in order; `folders`:
    the folder relative paths start from, and keel's cache (Hub datasets). DataError naming
    each row that cannot be one (data.on_invalid skip: skipped and counted), and each prompt
    over data.cutoff_len tokens (data.overlength drop: skipped and counted). The datasets
    follow one another (data.mix is training's: a mix that draws rows twice would count
    them twice); a dataset's num_samples draws with the request's seed, as LLaMA-Factory
    draws with its run's."""
    import dataclasses

    from keel.data.mixing import source_loader
    from keel.data.sources import resolve_sources

    base_dir, cache_dir = folders
    data = dataclasses.replace(request.data, mix="concat")
    sources = resolve_sources(data, base_dir, stage="sft")
    for note in (n for src in sources for n in src.notes):
        log(f"note: {note}")
    seed = request.answering.seed
    load = source_loader(data, cache_dir=cache_dir, base_dir=base_dir, seed=seed, log=log)
    prompts, rejections, overlong = [], [], []
    for src, units in zip(sources, load(sources)):
        readable = [u for u in units if u.dataset is not None and len(u.dataset)]
        first = readable[0].dataset[0] if readable else None
        where = f"{src.where}, file {readable[0].file}" if readable else src.where
        spec = _spec_of(src, first, where)
        for unit in units:
            rejections += unit.rejections
            for k, row in enumerate(unit.dataset if unit.dataset is not None else ()):
                number, line = unit.row_of(k)
                place = Rejection(unit.file, number, "", line)
                try:
                    prompt = _prompt(row, (src, spec), reader, place.where())
                except RowError as e:
                    rejections.append(Rejection(unit.file, number, str(e), line))
                    continue
                if len(prompt.ids) > min(data.cutoff_len, reader.context - 1):
                    overlong.append(f"{place.where()}: {len(prompt.ids)} tokens")
                    continue
                prompts.append(prompt)
    _check_rows(data, rejections, (overlong, reader.context), log)
    if not prompts:
        raise DataError("no rows to answer in data.datasets")
    return prompts


def _spec_of(src, first: dict | None, where: str):
    """How `src` is read: as SFT reads it (rows that end with their answer); a dataset of
    prompts alone (TRL's prompt-only rows, alpaca without outputs) as grpo reads it."""
    from keel.data.detect import spec_for_stage

    fmt = src.format
    if fmt == "auto" and first is not None:
        try:
            fmt = detect_format(first, src.columns, src.tags, where)
        except DataError:
            fmt = "auto"  # no SFT format: prompts, perhaps
    if fmt == "text":
        raise DataError(
            f"{where}: plain text (format text) holds no prompt to answer; keel predict reads "
            f"conversations (messages, sharegpt, alpaca), with or without the answer"
        )
    try:
        return spec_for_stage(first, src.format, src.columns, src.tags, "sft", where)
    except DataError as answered:
        try:
            return spec_for_stage(first, src.format, src.columns, src.tags, "grpo", where)
        except DataError:
            raise answered from None


def _prompt(row: dict, source, reader: _Reader, where: str) -> _Prompt:
    """`source`: the row's (keel.data.sources.Source, FormatSpec). A row that ends with the
    assistant's answer is a prompt and its label; one that ends with the user's turn (or an
    alpaca row without output, or TRL's prompt-only row) is a prompt without a label."""
    from keel.data.encode_prompt import prompt_ids
    from keel.data.template import render
    from keel.data.tools import check_tool_template

    src, spec = source
    row = without_system(row, spec) if src.config.drop_system else row
    messages, label, images, tools = _read_row(row, spec)
    tokenizer = reader.tokenizer
    if isinstance(messages, str):  # TRL's text prompt: continued as it is
        if images:
            raise RowError("a text prompt with images: give the prompt as messages")
        return _Prompt(where, prompt_ids(tokenizer, reader.template, messages), messages, label)
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        check_tool_template(reader.template)  # a DataError: the template, not the row
    if reader.system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": reader.system}, *messages]
    if images:
        return _prompt_with_images(messages, images, src.media_dir, reader, where, label)
    text = render(tokenizer, reader.template, messages, generation=True, tools=tools)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return _Prompt(where, ids, text, label)


def _read_row(row: dict, spec) -> tuple:
    """(the prompt: messages, or TRL's text prompt; the label, None without one; the images;
    the tool definitions). RowError when the row is neither answered nor a prompt (the
    answered reading's reason)."""
    from keel.data.encode_prompt import row_to_prompt
    from keel.data.tools import read_example

    if spec.format == "prompt":  # TRL's prompt-only rows: prompts alone
        asked = row_to_prompt(row, spec)
        return asked.prompt, None, asked.images, ()
    try:
        example = read_example(row, spec)  # tool definitions, calls and outputs too
    except RowError as answered:
        try:
            asked = row_to_prompt(row, spec)
        except RowError:
            raise answered from None
        return asked.prompt, None, asked.images, ()
    return example.content[:-1], example.content[-1]["content"], example.images, example.tools


def _prompt_with_images(messages, refs, media_dir, reader: _Reader, where, label) -> _Prompt:
    from keel.infer.vision import render

    if reader.vision is None:
        raise RowError(
            f"has {len(refs)} image(s), but the model is a text model; images need a "
            f"vision-language model (e.g. Qwen2-VL, LLaVA)"
        )
    try:
        prompt = _encode_images(reader, messages, refs, media_dir)
    except ImageError as e:
        raise RowError(str(e)) from None
    text = render(reader.tokenizer, messages)
    return _Prompt(where, list(prompt.input_ids), text, label, (messages, refs, media_dir))


def _encode_images(reader: _Reader, messages, refs, media_dir):
    from keel.infer.vision import encode_with_images
    from keel.models.vision.images import load_image

    images = [load_image(ref, media_dir) for ref in refs]
    return encode_with_images(reader.tokenizer, messages, images, reader.vision)


def _check_rows(data: DataConfig, rejections: list, overlong: tuple, log: Log) -> None:
    """`overlong`: (the prompts over the limit, the model's context length)."""
    if rejections and data.on_invalid == "error":
        lines = "\n".join(list_capped([str(r) for r in rejections]))
        raise DataError(
            f"{len(rejections)} row(s) cannot be answered and scored:\n{lines}\nfix them, or "
            f"skip them (data.on_invalid: skip; keel predict --skip-invalid)"
        )
    if rejections:
        log(f"skipped {len(rejections)} invalid row(s) (data.on_invalid: skip)")
    prompts, context = overlong
    if data.cutoff_len < context:
        limit = f"longer than cutoff_len={data.cutoff_len} tokens"
    else:  # the model's positions, not cutoff_len, bound them; an answer needs one at least
        limit = f"with no room to answer in the model's context of {context} tokens"
    if prompts and data.overlength != "drop":
        lines = "\n".join(list_capped(prompts))
        skip = "skip them (data.overlength: drop; keel predict --skip-long)"
        if data.cutoff_len < context:
            skip = f"raise cutoff_len (keel predict --cutoff-len), or {skip}"
        raise DataError(f"{len(prompts)} prompt(s) {limit}:\n{lines}\n{skip}")
    if prompts:
        log(f"skipped {len(prompts)} prompt(s) {limit}")


def _generate(model, reader: _Reader, todo: list[tuple[int, _Prompt]], answering, sinks):
    """Answer each (row index, prompt) of `todo` (row i samples with seed + i), a chunk of
    4 x max_batch_size rows at a time; `sinks`: (keep, log): keep(pairs) gets each chunk's
    (row index, Completion) pairs as it ends, then a progress line is logged."""
    from keel.infer.batch_generate import GroupRequest, Sampling, generate_groups

    keep, log = sinks
    banned = ()
    if reader.vision is not None:  # a completion holding an image token has no image for it
        banned = (reader.tokenizer.convert_tokens_to_ids(reader.vision.family.image_token),)
    sampling = Sampling(
        max_tokens=answering.max_new_tokens,
        temperature=answering.temperature,
        top_p=answering.top_p,
        banned=banned,
    )
    chunk = 4 * answering.max_batch_size
    new, started = 0, time.perf_counter()
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        requests = [
            GroupRequest(
                prompt_ids=p.ids, n=1, seed=answering.seed + i, images=p.image_prompt(reader)
            )
            for i, p in part
        ]
        done = generate_groups(
            model, reader.tokenizer, requests, sampling, max_batch_size=answering.max_batch_size
        )
        keep([(i, completions[0]) for (i, _), completions in zip(part, done)])
        new += sum(len(completions[0].token_ids) for completions in done)
        seconds = time.perf_counter() - started
        answered = start + len(part)
        log(f"predict: {answered}/{len(todo)} answered, {new / seconds:.1f} new tokens/s")


def _results(request: PredictRequest, answered: tuple, run: tuple) -> dict:
    """predict_results.json: `answered` (prompts, answers, their texts); `run` (seconds,
    processes)."""
    from keel import __version__
    from keel.infer.text_metrics import score_answers

    prompts, answers, texts = answered
    seconds, processes = run
    labelled = [(text, p.label) for text, p in zip(texts, prompts) if p.label is not None]
    scores = score_answers(labelled)
    new_tokens = sum(len(a.token_ids) for a in answers)
    answering = request.answering
    return {
        **{f"predict_{name}": value for name, value in scores.items()},
        "predict_samples": len(prompts),
        "predict_labelled": len(labelled),  # the rows scored: those with an answer
        # ended by max_new_tokens or by the model's context, not by the model
        "predict_cut_off": sum(a.finish_reason == "length" for a in answers),
        "predict_new_tokens": new_tokens,
        "predict_runtime": round(seconds, 4),
        "predict_samples_per_second": round(len(prompts) / seconds, 3),
        "predict_tokens_per_second": round(new_tokens / seconds, 3),
        "model": request.model,
        "adapter": request.adapter,
        "sampling": {
            "max_new_tokens": answering.max_new_tokens,
            "temperature": answering.temperature,
            "top_p": answering.top_p,
            "seed": answering.seed,
        },
        "processes": processes,
        "keel_version": __version__,
    }


def _summary(results: dict, out: Path) -> str:
    names = ("bleu-4", "rouge-1", "rouge-2", "rouge-l", "exact_match")
    scores = ", ".join(
        f"{name} {results[f'predict_{name}']:.2f}" for name in names if f"predict_{name}" in results
    )
    unscored = results["predict_samples"] - results["predict_labelled"]
    notes = [scores or "no labels to score"]
    if unscored and scores:
        notes.append(f"{unscored} without a label, not scored")
    if cut := results["predict_cut_off"]:
        notes.append(f"{cut} cut off (max_new_tokens, or the model's context)")
    return (
        f"predicted {results['predict_samples']} answers in {results['predict_runtime']:.1f} s "
        f"({results['predict_tokens_per_second']:.1f} new tokens/s): {'; '.join(notes)} -> {out}"
    )
