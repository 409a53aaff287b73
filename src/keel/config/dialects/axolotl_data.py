"""Axolotl's `datasets:` entries as keel's data.datasets. Each dataset key gets a fate named
`datasets.<index>.<key>`."""

from __future__ import annotations

from keel.config.dialects.build import Build
from keel.config.dialects.report import unknown_key
from keel.config.schema import REASONING_FIELDS
from keel.config.validate import is_hub_id

PAIR_STAGES = ("dpo", "orpo", "simpo", "rm")


_ALPACA_WHY = (
    "keel renders instruction/input/output through data.template (the chat template), "
    "not Axolotl's fixed 'Below is an instruction...' prompt text"
)
_CHAT_WHY = "OpenAI-style messages rendered through data.template"
_KTO_WHY = (
    "TRL's prompt/completion/label rows; Axolotl's '{t}' applies its own template, keel "
    "applies data.template"
)
_INTEL_WHY = "question/chosen/rejected/system rows: TRL's preference format with prompt=question"
_BRADLEY_TERRY = "bradley_terry.chat_template"
_BRADLEY_TERRY_WHY = (
    "system/input/chosen/rejected rows: TRL's preference format with prompt=input, each "
    "answer one assistant message, rendered through data.template"
)
_FILE_TYPES = ("json", "jsonl", "csv", "parquet", "arrow", "text")
_ROLE_TAGS = {
    "system": "system_tag",
    "user": "user_tag",
    "assistant": "assistant_tag",
    "tool": "observation_tag",
}
_COLUMNS = {
    "field_messages": "messages",
    "field_tools": "tools",  # tool definitions beside OpenAI/TRL tool_calls and tool turns
    "field_chosen": "chosen",
    "field_rejected": "rejected",
    "field_system": "system",
    "field_instruction": "prompt",
    "field_input": "query",
    "field_output": "response",
    "field": "prompt",
}
_PROPERTY_TAGS = {"role": "role_tag", "content": "content_tag"}
_LEGACY_TAGS = {"message_field_role": "role_tag", "message_field_content": "content_tag"}
_DATASET_KEYS = (
    *("path", "type", "split", "revision", "ds_type", "data_files", "name"),
    *("message_property_mappings", "roles", "roles_to_train", "train_on_eos"),
    "drop_system_message",
    *("field_thinking", "template_thinking_key"),
    *_COLUMNS,
    *_LEGACY_TAGS,
)


def dataset_stage(datasets) -> str | None:
    """pt when every dataset is `type: completion` (raw text), else None (the rl key or
    sft decides)."""
    if not isinstance(datasets, list) or not datasets:
        return None
    kinds = [entry.get("type") if isinstance(entry, dict) else None for entry in datasets]
    return "pt" if all(kind == "completion" for kind in kinds) else None


def translate_datasets(build: Build, value, key: str = "datasets") -> None:
    """`datasets:` -> data.datasets (key test_datasets: -> data.eval_datasets), one keel
    dataset per entry."""
    keel_key = "data.eval_datasets" if key == "test_datasets" else "data.datasets"
    if not isinstance(value, list) or not value:
        build.refused(key, f"{value!r} must be a list of datasets (path:, type:)")
        return
    out = []
    for index, entry in enumerate(value):
        prefix, target = f"{key}.{index}", f"{keel_key}.{index}"
        if isinstance(entry, str):
            build.mapped(prefix, f"{target}.path")
            out.append({"path": entry})
        elif isinstance(entry, dict):
            out.append(_dataset(build, prefix, target, entry))
        else:
            build.refused(prefix, f"{entry!r} must be a mapping with path: and type:")
    build.set(keel_key, out)
    if key == "test_datasets":
        return
    if build.stage == "pt":  # every dataset is type: completion
        why = "type: completion cuts each text into sequence_len pieces (after cutting it to "
        build.kept("data.overlength", "split", why + "64 x sequence_len; keel keeps all of it)")
    bradley_terry = [isinstance(e, dict) and e.get("type") == _BRADLEY_TERRY for e in value]
    if build.stage == "rm" and all(bradley_terry):
        why = f"Axolotl's {_BRADLEY_TERRY} trims each sequence to sequence_len"
        build.kept("data.overlength", "truncate", why + " (keel cuts the answers, never a prompt)")


def min_sample_len(build: Build, key: str, value) -> None:
    """Their shortest sample (and completion chunk) in tokens; shorter ones are dropped.
    Their preference and RL data are filtered by other rules, which do not read it."""
    if value is None:
        build.ignored(key, "empty: Axolotl's default (a sample of under 2 tokens trains nothing)")
    elif build.stage not in ("pt", "sft"):
        build.ignored(key, f"Axolotl does not read it for {build.stage}'s data")
    else:
        build.put(key, "data.min_len", value, "shorter samples and pieces are dropped")


def _dataset(build: Build, prefix: str, target: str, entry: dict) -> dict:
    ds: dict = {}
    for key, value in entry.items():
        name = f"{prefix}.{key}"
        if key == "path":
            ds["path"] = value
            build.mapped(name, f"{target}.path")
        elif key == "type":
            _type(build, name, value, ds, target)
        elif key in ("split", "revision"):
            ds[key] = value
            build.mapped(name, f"{target}.{key}")
        elif key == "name":  # load_dataset's name: a configuration of a Hub dataset
            ds["subset"] = value
            build.mapped(name, f"{target}.subset", "the Hub dataset's configuration")
        elif key in _COLUMNS:
            ds.setdefault("columns", {})[_COLUMNS[key]] = value
            build.mapped(name, f"{target}.columns.{_COLUMNS[key]}")
        elif key != "data_files":  # read once the path is known
            _other_key(build, name, key, value, ds, target)
    read_data_files(build, prefix, entry, ds, target)
    if ds.get("format") == "messages" and entry.get("roles") is None:
        _default_roles(build, ds, target)
    return ds


def _default_roles(build: Build, ds: dict, target: str) -> None:
    """Axolotl's chat_template reads `human` or `user`, `gpt` or `assistant` unless `roles:`
    says otherwise; keel reads one name per role: ShareGPT's where the messages hold
    from/value (FineTome and the like), else OpenAI's (keel's default)."""
    if ds.get("tags", {}).get("role_tag") != "from":
        return
    ds["tags"].update(user_tag="human", assistant_tag="gpt")
    build.notes.append(
        f"{target}.tags: user_tag human, assistant_tag gpt (Axolotl reads human or user, gpt "
        f"or assistant; keel reads one name per role, ShareGPT's for from/value messages; "
        f"`roles:` chooses)"
    )


def _other_key(build: Build, name: str, key: str, value, ds: dict, target: str) -> None:
    if value is None:
        build.ignored(name, "empty: Axolotl's default")
    elif key == "ds_type":
        _ds_type(build, name, value)
    elif key in _LEGACY_TAGS:
        ds.setdefault("tags", {})[_LEGACY_TAGS[key]] = value
        build.mapped(name, f"{target}.tags.{_LEGACY_TAGS[key]}")
    elif key == "message_property_mappings" and isinstance(value, dict):
        _tags(build, name, value, _PROPERTY_TAGS, ds, target)
    elif key == "roles" and isinstance(value, dict):
        _roles(build, name, value, ds, target)
    elif key == "roles_to_train":
        _roles_to_train(build, name, value)
    elif key == "train_on_eos":
        _train_on_eos(build, name, value)
    elif key in ("field_thinking", "template_thinking_key"):
        _thinking(build, name, key, value)
    elif key == "drop_system_message":
        ds["drop_system"] = bool(value)
        build.mapped(
            name, f"{target}.drop_system", "the template's own default system still applies"
        )
    else:
        why = "an Axolotl dataset key keel has no counterpart for; remove it"
        build.refused(name, unknown_key(key, _DATASET_KEYS, why))


def _thinking(build: Build, name: str, key: str, value) -> None:
    """Their names of an answer's reasoning, in the rows and in the template: keel reads
    reasoning_content or thinking from the rows and gives the template both."""
    if value in REASONING_FIELDS:
        build.ignored(
            name,
            f"{value}: keel reads an answer's reasoning from reasoning_content or thinking and "
            f"gives the chat template both",
        )
    else:
        where = "its messages" if key == "field_thinking" else "the chat template"
        build.refused(
            name,
            f"{value!r}: keel reads an answer's reasoning as reasoning_content or thinking in "
            f"{where}; rename the field",
        )


def _type(build: Build, name: str, kind, ds: dict, target: str) -> None:
    fmt, columns, why = _format_of(kind, build.stage)
    if fmt is None:
        build.refused(name, why)
        return
    ds["format"] = fmt
    if columns:
        ds.setdefault("columns", {}).update(columns)
    build.mapped(name, f"{target}.format", why)


def _format_of(kind, stage: str) -> tuple[str | None, dict, str]:
    """(keel format or None when refused, default columns, why) for Axolotl's `type`."""
    if kind == "alpaca":
        return "alpaca", {}, _ALPACA_WHY
    if kind == "completion":
        return "text", {}, "raw text, every token trained: keel's text format (train.stage pt)"
    if kind == "sharegpt":
        return "sharegpt", {}, "conversations with from/value (human/gpt)"
    if kind in ("chat_template", "chat_template.default"):
        why = _CHAT_WHY + (
            ", chosen/rejected as one assistant message each" if stage in PAIR_STAGES else ""
        )
        return "messages", {}, why
    if isinstance(kind, str) and kind.endswith(".ultra") and stage == "kto":
        return "kto", {}, _KTO_WHY.format(t=kind)
    if kind in ("chatml.intel", "llama3.intel") and stage in PAIR_STAGES:
        return "preference", {"prompt": "question"}, _INTEL_WHY
    if kind == _BRADLEY_TERRY and stage == "rm":
        return "preference", {"prompt": "input"}, _BRADLEY_TERRY_WHY
    if kind in ("chat_template.argilla", "chat_template.argilla_chat") and stage in PAIR_STAGES:
        why = (
            "chosen and rejected are whole conversations; their prompt column repeats the "
            "conversations' start, so it is not read (columns.prompt empty)"
        )
        return "preference", {"prompt": ""}, why
    return (
        None,
        {},
        (
            f"the prompt strategy {kind!r} is Axolotl code keel does not run; use type: "
            f"alpaca, chat_template, sharegpt or completion (or convert the rows)"
        ),
    )


def _ds_type(build: Build, name: str, value) -> None:
    if value in _FILE_TYPES:
        build.ignored(name, "keel reads the file type from the file's extension")
    else:
        build.refused(name, f"{value!r} is not a file type keel reads ({', '.join(_FILE_TYPES)})")


def read_data_files(build: Build, prefix: str, entry: dict, ds: dict, target: str) -> None:
    """An entry's data_files, once its path is known (`ds` holds it, whatever the keys'
    order)."""
    if entry.get("data_files") is not None:
        data_files(build, f"{prefix}.data_files", entry["data_files"], ds, target)
    elif "data_files" in entry:
        build.ignored(f"{prefix}.data_files", "empty: Axolotl's default")


def data_files(build: Build, name: str, value, ds: dict, target: str) -> None:
    """load_dataset's data_files: files inside the Hub dataset `path` names (keel's
    `files`), or inside a local folder (one file: the path to it)."""
    files = [value] if isinstance(value, str) else value
    if not (isinstance(files, list) and files and all(isinstance(f, str) for f in files)):
        build.refused(name, f"{value!r}: a file name or a list of them")
        return
    path = ds.get("path")
    local = path is not None and (build.source.parent / path).exists()
    if path is not None and not local and is_hub_id(path):
        ds["files"] = files
        build.mapped(name, f"{target}.files", "those files of the Hub dataset, its train split")
    elif len(files) == 1:
        ds["path"] = files[0] if path is None else f"{path.rstrip('/')}/{files[0]}"
        build.mapped(name, f"{target}.path", "keel reads that file of the folder")
    else:
        build.refused(name, "keel reads one local file per dataset; list each as its own dataset")


def _tags(build: Build, name: str, value: dict, names: dict, ds: dict, target: str) -> None:
    for prop, column in value.items():
        key = f"{name}.{prop}"
        if prop in names:
            ds.setdefault("tags", {})[names[prop]] = column
            build.mapped(key, f"{target}.tags.{names[prop]}")
        else:
            build.refused(key, "keel's messages read role and content only")


def _roles(build: Build, name: str, value: dict, ds: dict, target: str) -> None:
    for role, aliases in value.items():
        key = f"{name}.{role}"
        aliases = [aliases] if isinstance(aliases, str) else aliases
        if role not in _ROLE_TAGS:
            build.refused(key, f"keel's roles are {', '.join(_ROLE_TAGS)}")
        elif not isinstance(aliases, list) or len(aliases) != 1:
            build.refused(key, "keel's messages name one value per role; rewrite the rows")
        else:
            ds.setdefault("tags", {})[_ROLE_TAGS[role]] = aliases[0]
            build.mapped(key, f"{target}.tags.{_ROLE_TAGS[role]}")


def _roles_to_train(build: Build, name: str, value) -> None:
    if value in (["assistant"], ["gpt"], "assistant"):
        build.ignored(name, "keel trains on the assistant turns, as this asks")
    else:
        build.refused(name, "keel trains on assistant turns only")


def _train_on_eos(build: Build, name: str, value) -> None:
    if value == "turn":
        build.ignored(
            name, "Axolotl's default: each trained turn's end token is a target, as in keel"
        )
    else:
        build.refused(name, "keel trains the end token of every assistant turn (turn)")
