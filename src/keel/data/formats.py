"""Dataset formats: turn one row into a conversation (a list of {role, content}) or a text.

Column and tag names use LLaMA-Factory's vocabulary. A `DatasetConfig.columns`/`tags`
override renames these defaults:

- alpaca: prompt=instruction, query=input, response=output, system, history
  (history: [user, assistant] pairs before the current turn; query joins prompt with "\\n")
- sharegpt: messages=conversations, system; tags from/value, human/gpt/system
- messages (OpenAI): messages=messages; tags role/content, user/assistant/system
- text: prompt=text (pretraining only); with a query column too, prompt and query joined
  by "\\n" (how LLaMA-Factory pretrains on an alpaca entry)
- preference (TRL's preference format, dpo/orpo/simpo): prompt, chosen, rejected, system;
  each text or a list of messages (tags role/content, user/assistant/system)
- kto (TRL's unpaired preference format): prompt, response=completion, kto_tag=label, system
- prompt (TRL's prompt-only format, grpo): prompt, as text or a list of messages (tags
  role/content); alpaca, sharegpt and messages rows are prompts there too
  (keel.data.encode_prompt)

In the preference stages alpaca, sharegpt and messages also read chosen and rejected
(LLaMA-Factory's ranking data) or kto_tag; keel.data.preference turns such rows into pairs
and labelled samples.

A column or tag mapped to None is not read: a LLaMA-Factory entry that names its columns
or tags replaces the defaults (keel.data.dataset_info), as it does in LLaMA-Factory.

Images (LLaMA-Factory's and TRL's vocabulary): a row's `images` column lists image
references (paths relative to the dataset's folder, URLs, bytes) in the order of the `<image>`
placeholders in its text; TRL's `{"type": "image"}` content parts are placeholders too, and
an OpenAI `{"type": "image_url", "image_url": {"url": ...}}` part is a placeholder that
carries its own reference. `Example.images` holds the references in placeholder order;
keel.data.vision turns them into image tokens. Videos and audios are refused.

Tools: `row_to_example` refuses tool definitions and tool turns; for sft and pt,
keel.data.tools reads them (`read_example`). The preference and prompt stages refuse them.

Problems with a row raise `RowError`; the pipeline turns them into report rejections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from difflib import get_close_matches

from keel.config.schema import REASONING_FIELDS
from keel.errors import DataError
from keel.models.vision.family import PLACEHOLDER

FORMATS = ("messages", "sharegpt", "alpaca", "text", "preference", "kto", "prompt")
_MEDIA = ("images", "videos", "audios")
_UNSUPPORTED_MEDIA = ("videos", "audios")
_RANKING = {"chosen": "chosen", "rejected": "rejected", "kto_tag": "kto_tag"}  # preference stages
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
        **_RANKING,
    },
    "sharegpt": {"messages": "conversations", "system": "system", **_RANKING},
    "messages": {"messages": "messages", "system": "system", **_RANKING},
    "text": {"prompt": "text"},
    "preference": {
        "prompt": "prompt",
        "chosen": "chosen",
        "rejected": "rejected",
        "system": "system",
    },
    "kto": {"prompt": "prompt", "response": "completion", "kto_tag": "label", "system": "system"},
    "prompt": {"prompt": "prompt"},
}
for _cols in DEFAULT_COLUMNS.values():
    _cols.update({"tools": "tools", **{m: m for m in _MEDIA}})
DEFAULT_TAGS: dict[str, dict[str, str]] = {
    "sharegpt": {
        "role_tag": "from",
        "content_tag": "value",
        "user_tag": "human",
        "assistant_tag": "gpt",
        "observation_tag": "observation",
        "function_tag": "function_call",
        "system_tag": "system",
    },
    "messages": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "observation_tag": "tool",
        "function_tag": "function",
        "system_tag": "system",
    },
}
# TRL's preference and prompt-only formats hold OpenAI-style messages when conversational
for _fmt in ("preference", "kto", "prompt"):
    DEFAULT_TAGS[_fmt] = DEFAULT_TAGS["messages"]
COLUMN_KEYS = sorted({k for cols in DEFAULT_COLUMNS.values() for k in cols})
TAG_KEYS = sorted(DEFAULT_TAGS["sharegpt"])


class RowError(Exception):
    """A row that cannot be used; the message is the reason shown in the report."""


@dataclass(frozen=True)
class Example:
    """What one row holds: a conversation (list of {role, content}) or a text, and the
    references of its images in the order of the `<image>` placeholders in that text."""

    content: list[dict] | str
    images: tuple = ()
    tools: tuple = ()  # tool definitions for the template's `tools=` (keel.data.tools)


@dataclass(frozen=True)
class FormatSpec:
    """A format with its effective column and tag names (defaults, then overrides)."""

    format: str
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


def check_overrides(columns: dict, tags: dict, where: str) -> None:
    """Refuse unknown column/tag keys, suggesting the closest valid one."""
    problems = []
    for kind, given, valid in (("columns", columns, COLUMN_KEYS), ("tags", tags, TAG_KEYS)):
        for key in given:
            if key not in valid:
                close = get_close_matches(key, valid, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                problems.append(f"{kind}.{key} is not a known key{hint}; valid: {', '.join(valid)}")
    if problems:
        raise DataError(f"{where}: " + "; ".join(problems))


def make_spec(fmt: str, columns: dict, tags: dict) -> FormatSpec:
    """The spec for `fmt` with `columns`/`tags` laid over the defaults."""
    return FormatSpec(
        format=fmt,
        columns={**DEFAULT_COLUMNS[fmt], **columns},
        tags={**DEFAULT_TAGS.get(fmt, {}), **tags} if fmt in DEFAULT_TAGS else {},
    )


def detect_format(row: dict, columns: dict, tags: dict, where: str) -> str:
    """Guess the format of a dataset from the columns of its first row."""
    present = {k for k, v in row.items() if v is not None}
    message_cols = [columns["messages"]] if "messages" in columns else ["messages", "conversations"]
    for col in message_cols:
        if col in present:
            return chat_flavour(row[col], col, tags)
    if (
        columns.get("prompt", "instruction") in present
        and columns.get("response", "output") in present
    ):
        return "alpaca"
    if columns.get("prompt", "text") in present:
        return "text"
    raise DataError(
        f"{where}: cannot detect the data format from the columns {sorted(row)}; expected "
        f"'messages' (OpenAI), 'conversations' (sharegpt), 'instruction' + 'output' (alpaca) or "
        f"'text' (pretraining). Set format: and columns: for this dataset in data.datasets"
    )


def chat_flavour(conversation, col: str, tags: dict) -> str:
    """sharegpt (from/value) or OpenAI messages (role/content), judged from the first message."""
    if tags:
        return "sharegpt"
    first = conversation[0] if isinstance(conversation, list) and conversation else None
    if isinstance(first, dict):
        if "from" in first or "value" in first:
            return "sharegpt"
        if "role" in first or "content" in first:
            return "messages"
    return "sharegpt" if col == "conversations" else "messages"


def row_to_example(row: dict, spec: FormatSpec) -> Example:
    """The row's validated conversation (or text, for the text format) and its images.
    Raises RowError."""
    refuse_unsupported(row, spec.columns)
    inline: list = []  # image_url parts' references, None for the other placeholders
    if spec.format == "text":
        content = _text(row, spec.columns)
    elif spec.format == "alpaca":
        content = _alpaca(row, spec.columns)
    else:
        content = _chat(row, spec.columns, spec.tags, inline)
    if not isinstance(content, str):
        validate_conversation(content)
    texts = [content] if isinstance(content, str) else [m["content"] for m in content]
    return Example(content, row_images(row, spec.columns, texts, inline))


def row_images(row: dict, columns: dict, texts: list[str], inline: list) -> tuple:
    """The image references of a row in placeholder order: inline image_url references where
    they stand, the `images` column's in order for the other placeholders. RowError when the
    placeholders and the images do not pair up. A row without images keeps its placeholders
    as plain text here (a text model reads `<image>` as text; keel.data.vision checks)."""
    listed = column_images(row, columns)
    if not listed and not any(ref is not None for ref in inline):
        return ()
    col = columns.get("images") or "images"
    placeholders = sum(text.count(PLACEHOLDER) for text in texts)
    check_image_count(placeholders - sum(ref is not None for ref in inline), len(listed), col)
    if not any(ref is not None for ref in inline):
        return tuple(listed)
    if len(inline) != placeholders:
        raise RowError(
            f"{placeholders} image placeholder(s) in the conversation but {len(inline)} in its "
            f"messages: a system column with '{PLACEHOLDER}' cannot be mixed with image_url parts"
        )
    column = iter(listed)
    return tuple(ref if ref is not None else next(column) for ref in inline)


def check_image_count(placeholders: int, images: int, col: str = "images") -> None:
    """RowError naming both counts unless every placeholder has its image."""
    if placeholders != images:
        raise RowError(
            f"{placeholders} image placeholder(s) ('{PLACEHOLDER}' in the text or "
            f'{{"type": "image"}} parts) but {images} image(s) in column \'{col}\'; '
            f"each image needs one placeholder where it appears in the conversation"
        )


def column_images(row: dict, columns: dict) -> list:
    """The `images` column's references (a single one becomes a list of one)."""
    col = columns.get("images")
    value = row.get(col) if col else None
    if value in (None, "", []):
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def refuse_unsupported(row: dict, columns: dict) -> None:
    """Refuse rows with videos, audios or tool definitions (RowError); sft reads tool
    definitions through keel.data.tools, which lets this pass without them."""
    for key in _UNSUPPORTED_MEDIA:
        col = columns.get(key)
        if col and row.get(col):
            raise RowError(
                f"has {key} (column '{col}'); multimodal data other than images is not supported"
            )
    col = columns.get("tools")
    if col and row.get(col) not in (None, "", "[]", []):
        raise RowError(
            f"has tool definitions (column '{col}'); tool-calling data trains with "
            f"train.stage sft only"
        )


def required_text(row: dict, col: str, what: str = "field") -> str:
    value = row.get(col)
    if value is None:
        raise RowError(f"missing field '{col}'")
    if not isinstance(value, str):
        raise RowError(f"field '{col}' must be text, got {type(value).__name__}")
    if what == "text" and not value.strip():
        raise RowError(f"empty text (field '{col}')")
    return value


def _text(row: dict, c: dict) -> str:
    prompt, query = c["prompt"], c.get("query")
    if query is None:
        return required_text(row, prompt, what="text")
    if row.get(prompt) is None and row.get(query) is None:
        raise RowError(f"missing field '{prompt}'")
    text = "\n".join(x for x in (optional_text(row, prompt), optional_text(row, query)) if x)
    if not text.strip():
        raise RowError(f"empty text (fields '{prompt}' and '{query}')")
    return text


def optional_text(row: dict, col: str | None) -> str:
    value = row.get(col) if col else None
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowError(f"field '{col}' must be text, got {type(value).__name__}")
    return value


def _alpaca(row: dict, c: dict) -> list[dict]:
    prompt = alpaca_prompt(row, c)
    return [*prompt, {"role": "assistant", "content": required_text(row, c["response"])}]


def alpaca_prompt(row: dict, c: dict) -> list[dict]:
    """An alpaca row's turns before its answer: system, the history pairs, then the user turn
    (prompt and query joined by a newline)."""
    prompt = required_text(row, c["prompt"])
    query = optional_text(row, c.get("query"))
    system = optional_text(row, c.get("system"))
    history = row.get(c.get("history")) if c.get("history") else None
    messages = [{"role": "system", "content": system}] if system else []
    for i, pair in enumerate(history or [], 1):
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise RowError(f"field '{c['history']}': item {i} must be a [user, assistant] pair")
        if not all(isinstance(x, str) for x in pair):
            raise RowError(f"field '{c['history']}': item {i} must hold two strings")
        messages += [
            {"role": "user", "content": pair[0]},
            {"role": "assistant", "content": pair[1]},
        ]
    user = "\n".join(x for x in (prompt, query) if x)
    return [*messages, {"role": "user", "content": user}]


def _chat(row: dict, c: dict, t: dict, inline: list | None = None) -> list[dict]:
    col = c["messages"]
    conversation = row.get(col)
    if conversation is None:
        raise RowError(f"missing field '{col}'")
    return with_system(parse_messages(conversation, col, t, inline), row, c)


def without_system(row: dict, spec: FormatSpec) -> dict:
    """`row` without its system prompt: the system column emptied, and the system messages
    left out of each conversation column (messages, or a preference row's prompt, chosen
    and rejected)."""
    row = dict(row)
    system_col = spec.columns.get("system")
    if system_col in row:
        row[system_col] = None
    role, system = spec.tags.get("role_tag", "role"), spec.tags.get("system_tag", "system")
    for key in ("messages", "prompt", "chosen", "rejected"):
        col = spec.columns.get(key)
        value = row.get(col) if col else None
        if isinstance(value, list):
            row[col] = [m for m in value if not (isinstance(m, dict) and m.get(role) == system)]
    return row


def with_system(messages: list[dict], row: dict, c: dict) -> list[dict]:
    """`messages` with the row's system column in front, unless they start with a system turn."""
    system = optional_text(row, c.get("system"))
    if system and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system}, *messages]
    return messages


def parse_messages(conversation, col: str, t: dict, inline: list | None = None) -> list[dict]:
    """The messages of column `col` as {role, content}, roles mapped by the tags `t`.

    inline: receives, per image placeholder in order, an image_url part's reference or None."""
    if not isinstance(conversation, list):
        raise RowError(
            f"field '{col}' must be a list of messages, got {type(conversation).__name__}"
        )
    return [parse_message(m, i, col, t, inline) for i, m in enumerate(conversation, 1)]


def parse_message(m, i: int, col: str, t: dict, inline: list | None = None) -> dict:
    """Message `i` of column `col` as {role, content}; tool turns and unknown roles refused.
    Image content parts become `<image>` placeholders (their references go to `inline`)."""
    roles = {t["user_tag"]: "user", t["assistant_tag"]: "assistant", t["system_tag"]: "system"}
    roles.pop(None, None)  # a tag mapped to None: that role is not expected
    tool_roles = {t["observation_tag"], t["function_tag"]} - {None}
    if not isinstance(m, dict):
        raise RowError(f"message {i} of '{col}' is not an object")
    role = m.get(t["role_tag"])
    if role is None:
        raise RowError(f"message {i} of '{col}': missing field '{t['role_tag']}'")
    if role in tool_roles or m.get("tool_calls"):
        raise RowError(
            f"message {i} of '{col}' is a tool/function-call turn (role '{role}'); "
            f"tool-calling data trains with train.stage sft only"
        )
    if role not in roles:
        hint = ""
        if role == "system" and t["system_tag"] is None:
            hint = (
                "; the dataset's tags name no system_tag, so a system message is not "
                'expected (LLaMA-Factory skips such rows): add "system_tag": "system"'
            )
        raise RowError(
            f"message {i} of '{col}': unknown role '{role}' "
            f"(expected one of {', '.join(roles)}){hint}"
        )
    refs: list = []
    content = _message_content(m.get(t["content_tag"]), i, t["content_tag"], roles[role], refs)
    if inline is not None:
        inline += refs
    return {"role": roles[role], "content": content, **_reasoning(m, i, roles[role])}


def _reasoning(m: dict, i: int, role: str) -> dict:
    """{reasoning_content, thinking} of message `i`, or {} when it has none: a message
    carries its answer's reasoning under both names, for either kind of template
    (keel.data.template checks that it shows)."""
    found = {key: m[key] for key in REASONING_FIELDS if m.get(key) not in (None, "")}
    if not found:
        return {}
    key, text = next(iter(found.items()))
    if not isinstance(text, str):
        raise RowError(f"message {i}: field '{key}' must be text, got {type(text).__name__}")
    if len({str(v) for v in found.values()}) > 1:
        raise RowError(f"message {i}: fields {' and '.join(found)} hold different reasoning")
    if role != "assistant":
        raise RowError(f"message {i}: a {role} message holds reasoning ('{key}'); only answers do")
    return {"reasoning_content": text, "thinking": text}


def _message_content(content, i: int, tag: str, role: str, refs: list) -> str:
    if content is None:
        if role == "assistant":
            return ""  # reported as an empty answer
        raise RowError(f"message {i}: missing field '{tag}'")
    if isinstance(content, str):
        refs += [None] * content.count(PLACEHOLDER)
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(_content_part(part, i, refs) for part in content)
    raise RowError(f"message {i}: field '{tag}' must be text, got {type(content).__name__}")


def _content_part(part, i: int, refs: list) -> str:
    """One OpenAI/TRL content part as text: text as is, an image as a placeholder."""
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind == "text":
        text = str(part.get("text", ""))
        refs += [None] * text.count(PLACEHOLDER)
        return text
    if kind == "image":  # TRL: the image itself is the next one of the images column
        refs.append(None)
        return PLACEHOLDER
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise RowError(
                f'message {i}: an image_url part needs {{"image_url": {{"url": "..."}}}} '
                f"(a path, file:// or data: URL)"
            )
        refs.append(url)
        return PLACEHOLDER
    raise RowError(
        f"message {i}: content part of type '{kind}' is not supported (text and images only)"
    )


def validate_conversation(messages: list[dict]) -> None:
    """Optional system, then user/assistant alternating from user, ending with assistant."""
    roles = [m["role"] for m in messages]
    shown = ", ".join(roles) if len(roles) <= 12 else ", ".join(roles[:12]) + ", ..."
    rule = (
        "roles must be: optional system, then user and assistant alternating, ending with assistant"
    )
    offset = 1 if roles[:1] == ["system"] else 0
    if len(roles) == offset:
        raise RowError("conversation has no user/assistant messages")
    for j, role in enumerate(roles[offset:]):
        expected = "user" if j % 2 == 0 else "assistant"
        if role != expected:
            pos = j + offset + 1
            raise RowError(
                f"wrong role order: message {pos} is {role}, expected {expected}; {rule} (got: {shown})"
            )
    if roles[-1] != "assistant":
        raise RowError(
            f"wrong role order: the conversation ends with {roles[-1]}; {rule} (got: {shown})"
        )
    for pos, m in enumerate(messages, 1):
        if m["role"] != "system" and not m["content"].strip():
            if m["role"] == "assistant":
                raise RowError(f"empty answer (message {pos})")
            raise RowError(f"empty {m['role']} message (message {pos})")
