"""Chat templates: rendering a conversation and finding the tokens the model is trained on.

Masking works on characters, then tokens. For assistant message i the trained span is
[len(render(msgs[:i], add_generation_prompt=True)), len(render(msgs[:i+1]))), cut right
after the EOS text inside it (or before trailing whitespace when the template ends turns
with another token): the model learns to stop, not to emit the newline after the stop.
The full conversation is tokenized once with offsets; a token is a target when it starts
inside a span. Every prefix render must be a prefix of the full render, otherwise the
template rewrites history (e.g. drops earlier reasoning) and spans cannot be located.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError

from keel.config.schema import is_inline_template
from keel.data.formats import RowError
from keel.errors import DataError
from keel.files import read_text

# Plain ChatML, no default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateMismatch(Exception):
    """The template renders a prefix of a conversation differently from the whole."""


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # "tokenizer", "chatml", "inline", or the .jinja path as configured
    text: str


def resolve_template(setting: str, tokenizer, base_dir: Path) -> tuple[ChatTemplate, str | None]:
    """The template for `data.template`, and a note to log when falling back to chatml."""
    if setting == "auto":
        text = getattr(tokenizer, "chat_template", None)
        if isinstance(text, dict):  # named templates: use the default one
            text = text.get("default")
        if text:
            return ChatTemplate("tokenizer", text), None
        note = (
            "data.template: the tokenizer has no chat template; using the builtin chatml template"
        )
        return ChatTemplate("chatml", CHATML_TEMPLATE), note
    if setting == "chatml":
        return ChatTemplate("chatml", CHATML_TEMPLATE), None
    if is_inline_template(setting):
        return ChatTemplate("inline", setting), None
    path = Path(setting).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.suffix != ".jinja" and not path.is_file():
        raise DataError(
            f"data.template: '{setting}' is not auto, chatml, a path to a .jinja file, or a "
            f"Jinja template"
        )
    if not path.is_file():
        raise DataError(f"data.template: template file not found: {path}")
    text = read_text(path, what="chat template (data.template)", error=DataError)
    return ChatTemplate(setting, text), None


def render(
    tokenizer,
    template: ChatTemplate,
    messages: list[dict],
    generation: bool = False,
    tools: tuple = (),
) -> str:
    """The conversation as text (with the tool definitions `tools`, if any, as the template
    shows them). Template errors (e.g. raise_exception) are row problems."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template.text,
            tokenize=False,
            add_generation_prompt=generation,
            tools=list(tools) or None,
        )
    except TemplateError as e:
        raise RowError(f"the chat template refused this conversation: {e}") from None


def assistant_spans(
    tokenizer,
    template: ChatTemplate,
    messages: list[dict],
    last_only: bool = False,
    tools: tuple = (),
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of every assistant turn, answers
    and tool calls alike (of the last message only, which must then be an assistant turn,
    with `last_only`); `tools`: the tool definitions every render is given."""
    full = render(tokenizer, template, messages, tools=tools)
    eos = tokenizer.eos_token or ""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or (last_only and i != len(messages) - 1):
            continue
        _check_reasoning_shows(full, message, i, template)
        before = render(tokenizer, template, messages[:i], generation=True, tools=tools)
        upto = (
            full
            if i == len(messages) - 1
            else render(tokenizer, template, messages[: i + 1], tools=tools)
        )
        if not (full.startswith(before) and full.startswith(upto) and len(before) <= len(upto)):
            raise TemplateMismatch(
                f"rendering the conversation up to assistant message {i + 1} is not a prefix of "
                f"rendering all of it"
            )
        spans.append(_trim_span(full, len(before), len(upto), message["content"], eos))
    return full, spans


def _check_reasoning_shows(full: str, message: dict, i: int, template: ChatTemplate) -> None:
    """An answer's reasoning (reasoning_content) is in the render: a template that does not
    read it, or drops it (Qwen3's keeps the reasoning after the last user turn only), would
    train the answer without it, silently."""
    reasoning = message.get("reasoning_content", "").strip()
    if reasoning and reasoning not in full:
        raise RowError(
            f"assistant message {i + 1} has reasoning (reasoning_content/thinking) that the "
            f"chat template ({template.name}) does not render here: it reads neither field, "
            f"or drops it in this turn; put the reasoning in the answer itself (e.g. "
            f"<think>...</think>), keep it on the last answer only, or use a template that "
            f"renders it"
        )


def _trim_span(text: str, start: int, end: int, content: str, eos: str) -> tuple[int, int]:
    span = text[start:end]
    if eos:
        body = content.strip()
        at = span.find(body) if body else -1
        k = span.find(eos, at + len(body) if at >= 0 else 0)
        if k >= 0:
            return start, start + k + len(eos)
    return start, start + len(span.rstrip())


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose first character lies inside a span (both sorted)."""
    mask, j = [], 0
    for start, _ in offsets:
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        mask.append(j < len(spans) and spans[j][0] <= start)
    return mask


def encode_sft(
    tokenizer,
    template: ChatTemplate,
    messages: list[dict],
    last_only: bool = False,
    tools: tuple = (),
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation (with the tool definitions `tools`) and which
    of them are assistant tokens (of the last message only, with `last_only`: a preference
    completion)."""
    full, spans = assistant_spans(tokenizer, template, messages, last_only, tools)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), token_mask(enc["offset_mapping"], spans)


def encode_pt(
    tokenizer, text: str, special_tokens: bool = True, ids: list[int] | None = None
) -> tuple[list[int], list[bool]]:
    """Pretraining: the text (with the tokenizer's own BOS, if any) then EOS, all trained.
    `ids`: the text already tokenized (with the special tokens), as a batch call gives it."""
    if ids is None:
        ids = tokenizer(text, add_special_tokens=special_tokens)["input_ids"]
    ids = list(ids)
    eos_id = tokenizer.eos_token_id
    if not ids or ids[-1] != eos_id:
        ids.append(eos_id)
    return ids, [True] * len(ids)


def shift_targets(ids: list[int], mask: list[bool]) -> list[int]:
    """targets[i] = ids[i + 1] when that token is trained on, else -100; the last is -100."""
    if not ids:
        return []
    return [ids[i + 1] if mask[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]
