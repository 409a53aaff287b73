"""The format of a source for the stage that trains on it, and whether the two fit.

With `format: auto` the format comes from the columns of the source's first row: for pt and
sft as `keel.data.formats.detect_format` says; for the preference stages a conversation
column means sharegpt/messages, an instruction column with text answers alpaca (LLaMA-
Factory's ranking data), anything else TRL's formats (preference, kto). Data meant for
another stage is refused before any row is encoded, with the stage to use: SFT data given
to dpo would otherwise be rejected row by row for missing answers, and pairs given to sft
row by row for ending with a user turn. For grpo (prompts alone) a conversation column means
sharegpt/messages, an alpaca instruction alpaca, a `prompt` column TRL's prompt-only format;
conversations that end with the assistant's answer (SFT data) are refused.
"""

from __future__ import annotations

from keel.data.encode_prompt import CONVERT_HINT, AnsweredPrompt, row_to_prompt
from keel.data.formats import FormatSpec, RowError, chat_flavour, detect_format, make_spec
from keel.errors import DataError
from keel.stages.registry import get_stage, spoken, stages_of

_CONVERSATION_COLUMNS = ("messages", "conversations")
_KTO_LABELS = ("kto_tag", "label")  # LLaMA-Factory's column name, TRL's
# the format assumed, by the stage's data unit, when no row could be read
_UNREADABLE_FORMAT = {"pair": "preference", "sample": "kto", "prompt": "prompt"}


def spec_for_stage(
    first: dict | None, fmt: str, columns: dict, tags: dict, stage: str, where: str
) -> FormatSpec:
    """The FormatSpec for a source of format `fmt` (auto: detected from its `first` row,
    None when no row could be read) trained with `stage`. Raises DataError."""
    if fmt == "auto" and first is None:  # nothing readable: every row is already a rejection
        fmt = _UNREADABLE_FORMAT.get(get_stage(stage).unit, "messages")
    elif fmt == "auto":
        fmt, columns = _detect(first, columns, tags, stage, where)
    _check_format(fmt, stage, where)
    spec = make_spec(fmt, columns, tags)
    if first is not None:
        _check_answers(first, spec, stage, where)
    return spec


def _detect(row: dict, columns: dict, tags: dict, stage: str, where: str) -> tuple[str, dict]:
    """(format, columns) for `row`; the columns gain the conversation and label columns
    found where the format's defaults would name another one."""
    present = {k for k, v in row.items() if v is not None}
    found = {}
    unit = get_stage(stage).unit
    conversation = _first_present(present, columns.get("messages"), _CONVERSATION_COLUMNS)
    if unit == "sample" and (label := _first_present(present, None, _KTO_LABELS)):
        found["kto_tag"] = label
    if unit in ("pair", "sample"):
        fmt = _preference_format(row, present, conversation, columns, tags, unit)
    elif unit == "prompt":
        fmt = _prompt_format(row, present, conversation, columns, tags, where)
    else:
        # checked before detection, which would find no SFT format in TRL's columns
        if {columns.get("chosen", "chosen"), columns.get("rejected", "rejected")} <= present:
            raise _wrong_stage(row, "preference pairs (chosen, rejected)", stage, "pair", where)
        if {"completion", "label"} <= present:
            raise _wrong_stage(row, "KTO samples (completion, label)", stage, "sample", where)
        fmt = detect_format(row, columns, tags, where)
    if fmt in ("sharegpt", "messages") and conversation is not None:
        found["messages"] = conversation
    return fmt, {**found, **columns}


def _preference_format(row, present, conversation, columns, tags, unit) -> str:
    if conversation is not None:
        return chat_flavour(row[conversation], conversation, tags)
    prompt = columns.get("prompt", "instruction")
    if unit == "sample":
        alpaca = prompt in present and columns.get("response", "output") in present
        return "alpaca" if alpaca else "kto"
    answers = [row.get(columns.get(k, k)) for k in ("chosen", "rejected")]
    if prompt in present and all(isinstance(a, str) for a in answers):
        return "alpaca"  # LLaMA-Factory's ranking alpaca
    return "preference"


def _prompt_format(row, present, conversation, columns, tags, where) -> str:
    """grpo: a conversation; alpaca (an instruction column, or a text prompt column beside
    alpaca's input column); else TRL's prompt-only `prompt`, text or messages."""
    if conversation is not None:
        return chat_flavour(row[conversation], conversation, tags)
    name = columns.get("prompt") or ("instruction" if "instruction" in present else "prompt")
    if name not in present:
        raise DataError(
            f"{where}: cannot find prompts in the columns {sorted(row)}; expected 'prompt' "
            f"(TRL's prompt-only format: text or messages), 'instruction' (alpaca) or "
            f"'messages'/'conversations' ending with the user's turn. Set format: and "
            f"columns: for this dataset in data.datasets (e.g. columns: {{prompt: question}})"
        )
    text = isinstance(row[name], str)
    if text and (name == "instruction" or columns.get("query", "input") in present):
        return "alpaca"
    return "prompt"


def _first_present(present: set, override: str | None, names: tuple[str, ...]) -> str | None:
    if override is not None:
        return override if override in present else None
    return next((n for n in names if n in present), None)


def _check_format(fmt: str, stage: str, where: str) -> None:
    unit = get_stage(stage).unit
    text = spoken(stages_of("text"))
    if fmt == "prompt" and unit != "prompt":
        raise DataError(
            f"{where}: format prompt holds prompts alone (TRL's prompt-only format) for "
            f"train.stage {spoken(stages_of('prompt'))}, which generates the answers; "
            f"{stage} trains on answers given in the data: set train.stage, or the format"
        )
    if fmt == "text" and unit == "prompt":
        raise DataError(
            f"{where}: plain text (format text) holds no prompts for train.stage {stage}; give "
            f"prompts (TRL's prompt-only rows, alpaca instructions, or conversations ending "
            f"with the user's turn), or set train.stage: {text} to pretrain on it"
        )
    if fmt == "text" and unit == "conversation":
        raise DataError(
            f"{where}: plain text (format text) has no answers to train on in SFT; "
            f"set train.stage: {text} to continue pretraining on it, or give conversations"
        )
    if fmt == "text" and unit != "text":
        raise DataError(
            f"{where}: plain text (format text) has no answers to compare in train.stage "
            f"{stage}; give preference data, or set train.stage: {text}"
        )
    if fmt == "preference" and unit != "pair":
        raise DataError(
            f"{where}: format preference holds pairs (prompt, chosen, rejected) for train.stage "
            f"{spoken(stages_of('pair'))}, not {stage}; set train.stage, or use format kto "
            f"for labelled samples"
        )
    if fmt == "kto" and unit != "sample":
        raise DataError(
            f"{where}: format kto holds labelled samples (prompt, completion, label) for "
            f"train.stage {spoken(stages_of('sample'))}, not {stage}; set train.stage: "
            f"{spoken(stages_of('sample'))}"
        )


def _check_answers(row: dict, spec: FormatSpec, stage: str, where: str) -> None:
    """The first row has the answers `stage` trains on, and no answers of another stage."""
    present = {k for k, v in row.items() if v is not None}
    c = spec.columns
    answers = {c.get("chosen"), c.get("rejected")} - {None}
    labelled = c.get("kto_tag") is not None and c["kto_tag"] in present
    unit = get_stage(stage).unit
    if unit == "prompt":
        _check_prompt(row, spec, stage, where)
        return
    if unit == "pair" and not answers & present:
        raise _not_for_stage(row, stage, where)
    if unit == "sample" and not labelled:
        raise _not_for_stage(row, stage, where)
    if unit in ("text", "conversation") and answers and answers <= present:
        raise _wrong_stage(row, "preference pairs (chosen, rejected)", stage, "pair", where)
    if unit in ("text", "conversation") and labelled:
        raise _wrong_stage(row, f"KTO samples (label '{c['kto_tag']}')", stage, "sample", where)


def _check_prompt(row: dict, spec: FormatSpec, stage: str, where: str) -> None:
    """The first row is a prompt, not a conversation that ends with its answer (SFT data).
    Other problems with it are the row's, reported with the others."""
    try:
        row_to_prompt(row, spec)
    except AnsweredPrompt:
        raise DataError(
            f"{where}: the first row's conversation ends with the assistant's answer, so the "
            f"data looks like SFT data (train.stage {spoken(stages_of('conversation'))}), not "
            f"{stage} data. {CONVERT_HINT}"
        ) from None
    except RowError:
        pass


def _wrong_stage(row: dict, kind: str, stage: str, unit: str, where: str) -> DataError:
    """The data holds `unit` rows, which `stage` does not train on."""
    use = spoken(stages_of(unit))
    return DataError(
        f"{where}: the data holds {kind}, which train.stage {stage} cannot train on; set "
        f"train.stage to {use}, or give {stage} data (the first row has the columns "
        f"{sorted(row)})"
    )


def _not_for_stage(row: dict, stage: str, where: str) -> DataError:
    if get_stage(stage).unit == "sample":
        need = (
            "labelled samples: a prompt and a completion with a true/false label (TRL: "
            "prompt, completion, label; LLaMA-Factory: a conversation ending with the answer, "
            "plus kto_tag)"
        )
        other = f"{spoken(stages_of('pair'))} if it holds pairs"
    else:
        need = (
            "preference pairs: a prompt with a chosen and a rejected answer (TRL: prompt, "
            "chosen, rejected; LLaMA-Factory ranking data: instruction or conversations, "
            "plus chosen and rejected)"
        )
        other = f"{spoken(stages_of('sample'))} if it holds labelled samples"
    return DataError(
        f"{where}: train.stage {stage} needs {need}, but the first row has the columns "
        f"{sorted(row)}. For SFT data use train.stage {spoken(stages_of('conversation'))}; "
        f"use train.stage {other}; or name "
        f"the columns that hold the answers with columns: (e.g. chosen: better, rejected: worse)"
    )
