"""Preference rows: one row becomes a pair (dpo, orpo, simpo) or a labelled sample (kto).

A pair is a prompt (a conversation ending with a user turn) and two answers to it; a KTO
sample is a prompt, one answer and whether that answer is desirable. The formats, with the
column names of `keel.data.formats` (a `columns:` override renames them):

- preference (TRL): prompt, chosen, rejected. Each is text (the prompt becomes one user
  turn, an answer one assistant turn) or a list of messages. Without a prompt, chosen and
  rejected are whole conversations (TRL's implicit prompt); `columns: {prompt: ""}` reads
  no prompt column, for rows whose prompt column repeats those conversations' start
  (argilla's and UltraFeedback's binarized sets).
- kto (TRL's unpaired preference): prompt, completion, label; the same shapes.
- alpaca (LLaMA-Factory's ranking alpaca): instruction, input, system, history give the
  prompt as in SFT; chosen and rejected are text. With kto_tag instead: output is the answer.
- sharegpt / messages (LLaMA-Factory's ranking sharegpt): the conversation ends with a
  user turn; chosen and rejected are single assistant message objects. With kto_tag: the
  conversation ends with the answer, as in LLaMA-Factory's kto_en_demo.

Where messages are given, the prompt is every message before the last assistant one, and it
must be the same for chosen and rejected; earlier assistant turns are context, never trained.
Images (a vision-language run) belong to the prompt: its `<image>` placeholders, TRL's
`{"type": "image"}` and OpenAI `image_url` parts, with the `images` column, as in SFT
(keel.data.formats); each sequence of a pair holds them, and a KTO sample's mismatched
sequence holds its own prompt's (keel.data.kto). An answer with an image is refused.

Problems with a row raise `RowError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.data.formats import (
    FormatSpec,
    RowError,
    alpaca_prompt,
    parse_message,
    parse_messages,
    refuse_unsupported,
    required_text,
    row_images,
    validate_conversation,
    with_system,
)
from keel.models.vision.family import PLACEHOLDER


@dataclass(frozen=True)
class PairExample:
    prompt: list[dict]  # optional system, then user/assistant turns ending with a user turn
    chosen: str
    rejected: str
    images: tuple = ()  # the prompt's image references, in placeholder order


@dataclass(frozen=True)
class KtoExample:
    prompt: list[dict]
    completion: str
    desirable: bool
    images: tuple = ()  # the prompt's image references, in placeholder order


def row_to_pair(row: dict, spec: FormatSpec) -> PairExample:
    """The pair a row holds, checked. Raises RowError."""
    refuse_unsupported(row, spec.columns)
    c, t = spec.columns, spec.tags
    for col in (c["chosen"], c["rejected"]):
        if row.get(col) is None:
            raise RowError(
                f"prompt-only row: missing field '{col}' (a pair needs a chosen and a "
                f"rejected answer)"
            )
    inline: list = []  # the prompt's image placeholders: image_url references or None
    if spec.format == "alpaca":
        prompt = alpaca_prompt(row, c)
        chosen, rejected = required_text(row, c["chosen"]), required_text(row, c["rejected"])
    elif spec.format in ("sharegpt", "messages"):
        prompt = _conversation(row, c, t, inline)
        chosen = _answer_message(row[c["chosen"]], c["chosen"], t)
        rejected = _answer_message(row[c["rejected"]], c["rejected"], t)
    else:
        prompt, chosen, rejected = _trl_pair(row, c, t, inline)
    _check_prompt(prompt)
    if not chosen.strip():
        raise RowError(f"empty chosen answer (field '{c['chosen']}')")
    if not rejected.strip():
        raise RowError(f"empty rejected answer (field '{c['rejected']}')")
    if chosen == rejected:
        raise RowError("chosen and rejected answers are identical: nothing to prefer")
    if PLACEHOLDER in chosen or PLACEHOLDER in rejected:
        raise RowError(
            f"an answer holds an image ('{PLACEHOLDER}' or an image part); images belong to "
            f"the prompt, which both answers share"
        )
    images = row_images(row, c, [m["content"] for m in prompt], inline)
    return PairExample(prompt, chosen, rejected, images)


def row_to_kto(row: dict, spec: FormatSpec) -> KtoExample:
    """The labelled sample a row holds, checked. Raises RowError."""
    refuse_unsupported(row, spec.columns)
    c, t = spec.columns, spec.tags
    label = row.get(c["kto_tag"])
    if label is None:
        raise RowError(
            f"missing field '{c['kto_tag']}' (KTO needs a true/false label on every sample)"
        )
    if not isinstance(label, bool):
        raise RowError(
            f"field '{c['kto_tag']}' must be true or false, got {type(label).__name__} {label!r}"
        )
    inline: list = []  # the conversation's image placeholders: image_url references or None
    if spec.format == "alpaca":
        prompt = alpaca_prompt(row, c)
        completion = required_text(row, c["response"])
    elif spec.format in ("sharegpt", "messages"):
        prompt, completion = _last_answer(_conversation(row, c, t, inline), c["messages"])
    else:
        answer = row.get(c["response"])
        if answer is None:
            raise RowError(f"prompt-only row: missing field '{c['response']}'")
        prompt = _given_prompt(row, c, t, implicit=isinstance(answer, list), inline=inline)
        turns = _turns(answer, c["response"], "assistant", t, inline)
        prompt, completion = _last_answer(prompt + turns, c["response"])
        prompt = with_system(prompt, row, c)
    _check_prompt(prompt)
    if not completion.strip():
        raise RowError("empty completion (the answer to label)")
    if PLACEHOLDER in completion:
        # its KL sequence pairs this prompt with another sample's answer: an image there
        # would belong to neither
        raise RowError(
            f"the answer holds an image ('{PLACEHOLDER}' or an image part); images belong to "
            f"the prompt"
        )
    images = row_images(row, c, [m["content"] for m in prompt], inline)
    return KtoExample(prompt, completion, label, images)


def _trl_pair(row: dict, c: dict, t: dict, inline: list) -> tuple[list[dict], str, str]:
    """TRL's pair; `inline` receives the prompt's image placeholders (see row_to_pair)."""
    whole = all(isinstance(row[c[k]], list) for k in ("chosen", "rejected"))
    given = _given_prompt(row, c, t, implicit=whole, inline=inline)
    in_chosen, in_rejected = [], []  # implicit prompts: their placeholders are the prompt's
    prompt, chosen = _last_answer(
        given + _turns(row[c["chosen"]], c["chosen"], "assistant", t, in_chosen), c["chosen"]
    )
    shared, rejected = _last_answer(
        given + _turns(row[c["rejected"]], c["rejected"], "assistant", t, in_rejected),
        c["rejected"],
    )
    inline += in_chosen
    if shared != prompt or in_chosen != in_rejected:
        raise RowError(
            f"'{c['chosen']}' and '{c['rejected']}' differ before their last assistant "
            f"message; only the last assistant turn may differ (the prompt is the messages "
            f"before it)"
        )
    return with_system(prompt, row, c), chosen, rejected


def _conversation(row: dict, c: dict, t: dict, inline: list | None = None) -> list[dict]:
    col = c["messages"]
    if row.get(col) is None:
        raise RowError(f"missing field '{col}'")
    return with_system(parse_messages(row[col], col, t, inline), row, c)


def _answer_message(value, col: str, t: dict) -> str:
    """LLaMA-Factory's ranking sharegpt: chosen/rejected are one assistant message object."""
    if not isinstance(value, dict):
        raise RowError(
            f"field '{col}' must be one assistant message object such as "
            f'{{"{t["role_tag"]}": "{t["assistant_tag"]}", "{t["content_tag"]}": "..."}}, '
            f"got {type(value).__name__}"
        )
    message = parse_message(value, 1, col, t)
    if message["role"] != "assistant":
        raise RowError(
            f"wrong role order: field '{col}' is a {message['role']} message; it must be the "
            f"assistant's answer (role '{t['assistant_tag']}')"
        )
    return message["content"]


def _turns(value, col: str, role: str, t: dict, inline: list | None = None) -> list[dict]:
    """TRL's columns: text is one turn of `role`; a list is messages."""
    if isinstance(value, str):
        if inline is not None:
            inline += [None] * value.count(PLACEHOLDER)
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return parse_messages(value, col, t, inline)
    raise RowError(f"field '{col}' must be text or a list of messages, got {type(value).__name__}")


def _given_prompt(
    row: dict, c: dict, t: dict, *, implicit: bool, inline: list | None = None
) -> list[dict]:
    """The prompt column as turns; absent (or not read: `columns: {prompt: ""}`, for rows
    whose prompt column repeats the conversations' start), an empty prompt when the answers
    are whole conversations (TRL's implicit prompt)."""
    if not c["prompt"] or row.get(c["prompt"]) is None:
        if implicit:
            return []
        if not c["prompt"]:
            raise RowError(
                "columns.prompt is empty (no prompt column is read), so chosen and rejected "
                "must be whole conversations"
            )
        raise RowError(
            f"missing field '{c['prompt']}': with text answers the prompt must be given (only "
            f"answers that are whole conversations carry their own prompt)"
        )
    return _turns(row[c["prompt"]], c["prompt"], "user", t, inline)


def _last_answer(messages: list[dict], col: str) -> tuple[list[dict], str]:
    """(the messages before the last one, the last one's text); the last must be assistant."""
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "nothing"
        raise RowError(
            f"wrong role order: the conversation of '{col}' ends with {last}; it must end "
            f"with the assistant's answer"
        )
    return messages[:-1], messages[-1]["content"]


def _check_prompt(prompt: list[dict]) -> None:
    """Optional system, then user/assistant alternating from user, ending with user."""
    roles = [m["role"] for m in prompt]
    if roles and roles[-1] != "user":
        raise RowError(
            f"wrong role order: the prompt ends with {roles[-1]}; it must end with a user "
            f"message (the answers follow it)"
        )
    validate_conversation([*prompt, {"role": "assistant", "content": "answer"}])
