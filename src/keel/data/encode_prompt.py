"""Prompts → tokens for the online stage (grpo): the rows its rollouts are generated from.

Each dataset row becomes one prompt row, never packed (the rollout source answers each
prompt `num_generations` times every step; keel.train.rollouts):

- input_ids: the prompt's tokens. A conversational prompt is rendered with the chat template
  and its generation prompt (the assistant's turn opened), as TRL's GRPOTrainer tokenizes it;
  a text prompt (TRL's standard format) is tokenized as is, with the tokenizer's own BOS rule
  as pretraining text, and no EOS: the policy continues it.
- num_targets: 0 (what is trained, the completions, is generated each step)
- prompt: JSON of the prompt as reward functions receive it: the text, or the messages
  ([{role, content}])
- columns: JSON of every other column of the row, values as read (numbers stay numbers):
  reward functions receive each as a keyword argument (`answer`, ...), as in TRL

Formats (the column names of keel.data.formats; a `columns:` override renames them):

- prompt (TRL's prompt-only format): `prompt`, text or a list of messages
- alpaca (LLaMA-Factory): system, history, instruction and input make the prompt exactly as
  in SFT (`alpaca_prompt`); the answer column (`output`) is not read, so it stays a column
  a reward function may compare with
- sharegpt / messages: the conversation, with the system column in front; it must end with
  the user's turn: one ending with the assistant's answer is SFT data (`AnsweredPrompt`)

data.cutoff_len bounds the prompt. Over it, data.overlength drop and error act as for every
row; truncate rejects the row, since a cut prompt asks a question never asked (the
preference encoders never cut a prompt either).

With a vision-language model a prompt may hold images (placeholders, image_url parts, the
`images` column, as in SFT): its ids hold each image's tokens, and the row carries
`image_blobs` and, for M-RoPE families, the prompt's `rope_positions`, from which the
rollouts are generated and trained (keel.train.rollouts), and `image_refs`, JSON of
{"column": the images column's name, "refs": each image's portable reference}: reward
functions receive the images, decoded, under that name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from keel.data.encode import RowEncoder, output_features
from keel.data.formats import (
    Example,
    FormatSpec,
    RowError,
    alpaca_prompt,
    check_image_count,
    parse_messages,
    refuse_unsupported,
    row_images,
    validate_conversation,
    with_system,
)
from keel.data.template import ChatTemplate, render
from keel.data.vision import (
    ImageTokens,
    expand_placeholders,
    image_columns,
    image_file,
    portable_image_ref,
    prepare_images,
    refuse_images,
    vision_features,
)
from keel.errors import ImageError
from keel.models.vision.family import PLACEHOLDER

IMAGE_REFS = "image_refs"  # a vision-language prompt row's images for the reward functions

# The columns each format builds its prompt from (keys of FormatSpec.columns); the media and
# tool columns are read too (refused when they hold anything), so neither is kept as a column
_PROMPT_KEYS = {
    "prompt": ("prompt",),
    "alpaca": ("prompt", "query", "system", "history"),
    "sharegpt": ("messages", "system"),
    "messages": ("messages", "system"),
}
_READ_KEYS = ("images", "videos", "audios", "tools")
CONVERT_HINT = (
    "train.stage grpo generates the answers itself, so each row must be a prompt: a conversation ending "
    "with the user's turn (or TRL's prompt-only row, {\"prompt\": ...}). Drop the last "
    'assistant message, and keep it in another column (e.g. "answer") if a reward '
    "function compares with it; an alpaca row's output column is kept that way already"
)


class AnsweredPrompt(RowError):
    """A conversation that ends with the assistant's answer: SFT data, not a prompt."""


@dataclass(frozen=True)
class PromptExample:
    """A row's prompt and the names of the columns it was built from."""

    prompt: str | list[dict]  # text, or messages ending with the user's turn
    read: frozenset[str]  # not kept in `columns`
    images: tuple = ()  # the prompt's image references, in placeholder order


def row_to_prompt(row: dict, spec: FormatSpec) -> PromptExample:
    """The prompt a row holds, checked. Raises RowError (AnsweredPrompt for SFT rows)."""
    refuse_unsupported(row, spec.columns)
    c, t = spec.columns, spec.tags
    inline: list = []  # image_url parts' references (None for the other placeholders)
    if spec.format == "alpaca":
        prompt = alpaca_prompt(row, c)
    elif spec.format in ("sharegpt", "messages"):
        if row.get(c["messages"]) is None:
            raise RowError(f"missing field '{c['messages']}'")
        prompt = with_system(parse_messages(row[c["messages"]], c["messages"], t, inline), row, c)
    else:
        prompt = _trl_prompt(row, c["prompt"], t, inline)
    if not isinstance(prompt, str):
        check_prompt_turns(prompt)
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    images = row_images(row, c, texts, inline)
    keys = (*_PROMPT_KEYS.get(spec.format, ("prompt",)), *_READ_KEYS)
    return PromptExample(prompt, frozenset(c[k] for k in keys if c.get(k)), images)


def _trl_prompt(row: dict, col: str, t: dict, inline: list) -> str | list[dict]:
    value = row.get(col)
    if value is None:
        raise RowError(f"missing field '{col}'")
    if isinstance(value, list):
        return parse_messages(value, col, t, inline)
    if not isinstance(value, str):
        raise RowError(
            f"field '{col}' must be text or a list of messages, got {type(value).__name__}"
        )
    if not value.strip():
        raise RowError(f"empty prompt (field '{col}')")
    return value


def check_prompt_turns(messages: list[dict]) -> None:
    """Optional system, then user/assistant alternating from user, ending with user."""
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise RowError("the prompt has no user message")
    if roles[-1] == "assistant":
        raise AnsweredPrompt(
            f"the conversation ends with the assistant's answer (message {len(roles)}); "
            f"{CONVERT_HINT}"
        )
    validate_conversation([*messages, {"role": "assistant", "content": "answer"}])


def kept_columns(row: dict, read: frozenset[str]) -> str:
    """JSON of the row's columns that are not in `read`, values as read. RowError naming a
    column whose value JSON cannot hold."""
    kept = {k: v for k, v in row.items() if k not in read}
    for name, value in kept.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise RowError(
                f"column '{name}' holds {type(value).__name__}, which reward functions cannot "
                f"receive (columns reach them as JSON values); convert it or drop the column"
            ) from None
    return json.dumps(kept, ensure_ascii=False)


def prompt_ids(tokenizer, template: ChatTemplate, prompt: str | list[dict]) -> list[int]:
    """The prompt's tokens: messages with the chat template's generation prompt; text as is,
    with the tokenizer's BOS rule."""
    if not isinstance(prompt, str):
        text = render(tokenizer, template, prompt, generation=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token
    # a tokenizer that closes every text with EOS (add_eos_token) would end the prompt
    # before its answer: the policy continues a prompt
    if ids and ids[-1] == tokenizer.eos_token_id and not (eos and prompt.endswith(eos)):
        ids.pop()
    return ids


def prompt_with_images(tokenizer, settings, example: PromptExample) -> tuple[list[int], dict]:
    """A vision-language run's prompt: its ids with each image's tokens, and its image
    columns (image_blobs, rope_positions for M-RoPE families, image_files). RowError when
    the placeholders and images do not pair up, or an image cannot be read."""
    vision, prompt = settings.vision, example.prompt
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    column = settings.spec.columns.get("images") or "images"
    check_image_count(placeholders, len(example.images), column)
    prepared = prepare_images(vision, example.images, settings.media_dir)
    ids = prompt_ids(tokenizer, settings.template, expand_placeholders(prompt, prepared))
    image_id = tokenizer.convert_tokens_to_ids(vision.family.image_token)
    count, want = sum(token == image_id for token in ids), sum(p.num_tokens for p in prepared)
    if count != want:
        raise RowError(
            f"the prompt's images are {want} image features but its text tokenizes to {count} "
            f"'{vision.family.image_token}' tokens: the tokenizer must have that token as a "
            f"special token (the model folder's tokenizer)"
        )
    files = (image_file(ref, settings.media_dir) for ref in example.images)
    images = ImageTokens(tuple(prepared), (), tuple(str(f) for f in files if f))
    try:
        refs = [portable_image_ref(ref, settings.media_dir) for ref in example.images]
    except ImageError as e:
        raise RowError(str(e)) from None
    return ids, {
        **image_columns(vision, [(ids, images)]),
        "image_files": list(images.files),
        IMAGE_REFS: json.dumps({"column": column, "refs": refs}),
    }


class PromptEncoder(RowEncoder):
    """grpo: a row → its prompt's input_ids, `prompt` and `columns` (see the module)."""

    def features(self):
        from datasets import Value

        prompt = {"prompt": Value("string"), "columns": Value("string")}
        if self.settings.vision is not None:
            prompt[IMAGE_REFS] = Value("string")
        return output_features(prompt | vision_features(self.settings.vision))

    def encode_row(self, row: dict) -> dict:
        s = self.settings
        extra = {}
        try:
            example = row_to_prompt(row, s.spec)
            columns = kept_columns(row, example.read)
            if s.vision is None:
                refuse_images(Example(example.prompt, example.images))
                ids = prompt_ids(self.tokenizer, s.template, example.prompt)
            else:
                ids, extra = prompt_with_images(self.tokenizer, s, example)
        except RowError as e:
            return {"status": "rejected", "reason": str(e)}
        length = len(ids)
        if length > s.cutoff_len:
            if s.overlength == "truncate":
                reason = (
                    f"the prompt is {length} tokens, over cutoff_len {s.cutoff_len} "
                    f"(data.overlength=truncate never cuts a prompt: a cut prompt asks a "
                    f"question never asked); raise data.cutoff_len or shorten the prompt"
                )
                return {"status": "rejected", "reason": reason, "length": length}
            status = "dropped" if s.overlength == "drop" else "overlength"
            return {"status": status, "length": length}
        return {
            "status": "ok",
            "length": length,
            "input_ids": ids,
            "prompt": json.dumps(example.prompt, ensure_ascii=False),
            "columns": columns,
            **extra,
        }


def prompt_rows(units: pa.Table) -> pa.Table:
    """One row per encoded prompt, in order: input_ids, num_targets (0), prompt, columns
    (and a vision-language run's image_blobs, rope_positions and image_refs)."""
    kept = ("image_blobs", "rope_positions", IMAGE_REFS)
    images = [name for name in kept if name in units.column_names]
    return pa.table(
        {
            "input_ids": units.column("input_ids"),
            "num_targets": pa.array(np.zeros(units.num_rows, dtype=np.int64)),
            "prompt": units.column("prompt"),
            "columns": units.column("columns"),
            **{name: units.column(name) for name in images},
        }
    )
