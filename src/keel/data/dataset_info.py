"""LLaMA-Factory's `dataset_info.json`: a registry of named datasets in `data.dataset_dir`.

An entry means here what it means in LLaMA-Factory (its data/README.md, and in
src/llamafactory/data: parser.py `DatasetAttr.join`, loader.py `_load_single_dataset`,
converter.py, processor/pretrain.py):

- `columns` and `tags`, when an entry gives them, replace the defaults: a column or tag
  it does not name is not read. Without `columns`, alpaca reads instruction / input /
  output and sharegpt reads conversations; system and history only when named. Without
  `tags`, sharegpt uses from/value and human/gpt/system/observation/function_call.
- SFT: the alpaca user turn is prompt and query joined by a newline, after the history
  pairs, with system as the system prompt; sharegpt maps roles by the tags.
- Pretraining (train.stage pt): the text is prompt and query joined by a newline, then EOS;
  that is how LLaMA-Factory declares a corpus (`"columns": {"prompt": "text"}`). It drops
  every other column there (for sharegpt it keeps only the first user message), so keel
  refuses entries that would lose text that way instead of dropping it silently.
- `num_samples`, `split`, `folder`, `subset`: see `resolve_entry` and keel.data.sampling.

- Preference data: an entry with `"ranking": true` holds pairs (chosen and rejected
  columns; for sharegpt the conversation ends with a user turn and each answer is one
  message object) and trains with train.stage dpo, orpo or simpo; an entry with a
  `kto_tag` column holds labelled samples (the answer is `response` for alpaca, the last
  message for sharegpt) and trains with kto. Each is refused for other stages, and entries
  that are neither are refused for those stages, as LLaMA-Factory's loader does.
- Prompts (train.stage grpo, which LLaMA-Factory does not have): alpaca and sharegpt entries
  give the prompt as they give SFT's, without the answer (a response column the entry names
  stays a column for the reward functions; a sharegpt conversation must end with the user's
  turn); ranking and kto_tag entries are refused, as for SFT.

- Tool calling (`columns.tools`, function_call and observation messages, as
  glaive_toolcall_en_demo): trains with train.stage sft, rendered with the chat template's
  tools (keel.data.tools).

An `hf_hub_url` entry is read as a Hugging Face Hub dataset (keel.data.hub: the hub cache,
offline when HF_HUB_OFFLINE is set), its `subset` the configuration and its `folder` a folder
in the repo, as LLaMA-Factory loads it; an entry with a file_name too reads that local file
(LLaMA-Factory would load the hub id), saying so. ModelScope, Modelers, script and cloud
entries are refused with the reason, and so are entries with videos or audios. An `images`
column holds each row's image paths, relative to data.dataset_dir (LLaMA-Factory's media_dir
default).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from keel.config.validate import is_hub_id
from keel.data.formats import COLUMN_KEYS, DEFAULT_TAGS
from keel.errors import DataError
from keel.files import read_text
from keel.stages.registry import get_stage, spoken, stages_of

INFO_FILE = "dataset_info.json"
_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_ENTRY_KEYS = (
    *_HUB_KEYS,
    *("file_name", "formatting", "ranking", "subset", "split", "folder", "num_samples"),
    *("columns", "tags"),
)
LF_COLUMNS = (
    *("prompt", "query", "response", "history", "messages", "system", "tools"),
    *("images", "videos", "audios", "chosen", "rejected", "kto_tag"),
)
LF_TAGS = tuple(DEFAULT_TAGS["sharegpt"])
# parser.py DatasetAttr defaults: used only when the entry has no "columns" at all
_LF_DEFAULT_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "messages": "conversations",
}
_UNSUPPORTED_MEDIA = ("videos", "audios")  # images are read (keel.data.vision)


@dataclass
class InfoEntry:
    """A resolved `dataset_info.json` entry, in keel's terms."""

    name: str
    path: Path | None  # the file or folder, absolute; None: a Hub dataset (hub_id)
    formatting: str  # a keel format: alpaca, sharegpt, or text (an alpaca corpus in pt)
    columns: dict[str, str | None] = field(default_factory=dict)  # None: not read
    tags: dict[str, str | None] = field(default_factory=dict)
    split: str | None = None
    num_samples: int | None = None
    notes: list[str] = field(default_factory=list)  # logged once when the data is prepared
    raw: dict = field(default_factory=dict)  # the entry as written (for the cache fingerprint)
    hub_id: str | None = None  # hf_hub_url: a Hub dataset, read through the hub cache
    subset: str | None = None  # of a Hub dataset: the configuration to read
    folder: str | None = None  # of a Hub dataset: the folder in the repo to read


def load_dataset_info(dataset_dir: Path) -> dict[str, dict]:
    """Parse `<dataset_dir>/dataset_info.json`; a missing or malformed file is a DataError."""
    info_path = dataset_dir / INFO_FILE
    if not info_path.is_file():
        raise DataError(
            f"data.dataset_dir: {dataset_dir} has no {INFO_FILE}; point data.dataset_dir at the "
            f"folder that holds it, or remove data.dataset_dir and give file paths"
        )
    text = read_text(info_path, what="dataset registry", error=DataError)
    try:
        info = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{info_path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    if not isinstance(info, dict):
        raise DataError(f"{info_path}: expected an object mapping dataset names to entries")
    return info


def closest_names(name: str, names: list[str], n: int = 3) -> list[str]:
    """The registered names closest to `name` (difflib), best first."""
    return difflib.get_close_matches(name, names, n=n, cutoff=0.4)


def unknown_name_error(name: str, info: dict, dataset_dir: Path) -> DataError:
    close = closest_names(name, list(info))
    hint = f"; closest: {', '.join(close)}" if close else ""
    return DataError(
        f"data.datasets: '{name}' is neither a file under the config's folder nor a name in "
        f"{dataset_dir / INFO_FILE}{hint}"
    )


def resolve_entry(
    name: str,
    info: dict,
    dataset_dir: Path,
    *,
    stage: str | None = None,
    config_format: str = "auto",
) -> InfoEntry:
    """Turn entry `name` into an InfoEntry, refusing what keel cannot train on as asked.

    stage: pt, sft, dpo, orpo, simpo or kto; the entry's meaning depends on it (None:
    checks that need it are left to the call that knows it). config_format: the config's `format` for this dataset; not
    auto, it replaces LLaMA-Factory's reading of the entry by keel's own for that format (the
    entry's columns and tags then only rename keel's defaults).
    """
    entry = info[name]
    where = f"{dataset_dir / INFO_FILE} entry '{name}'"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected an object with file_name, formatting, columns")
    _refuse_unsupported(entry, where)
    _check_stage(entry, where, stage)
    notes = _unknown_key_notes(entry, where)
    hub_id = _hub_id(entry, where)
    path = _local_path(entry, dataset_dir, where, notes) if hub_id is None else None
    if config_format == "auto":
        fmt, columns, tags = _lf_reading(entry, where, stage)
    else:
        fmt = config_format
        columns = dict(_names(entry, "columns", LF_COLUMNS, where) or {})
        tags = dict(_names(entry, "tags", LF_TAGS, where) or {})
        columns = {k: v for k, v in columns.items() if k in COLUMN_KEYS}
    split = entry.get("split")
    if split is not None and not isinstance(split, str):
        raise DataError(f'{where}: split must be a string such as "train", got {split!r}')
    return InfoEntry(
        name=name,
        path=path,
        formatting=fmt,
        columns=columns,
        tags=tags,
        split=split,
        num_samples=_num_samples(entry, where),
        notes=notes,
        raw=entry,
        hub_id=hub_id,
        subset=_text(entry, "subset", where) if hub_id else None,
        folder=_text(entry, "folder", where) if hub_id else None,
    )


def _refuse_unsupported(entry: dict, where: str) -> None:
    columns = entry.get("columns") if isinstance(entry.get("columns"), dict) else {}
    media = [k for k in _UNSUPPORTED_MEDIA if columns.get(k)]
    if media:
        raise DataError(
            f"{where} is multimodal (columns.{media[0]}: '{columns[media[0]]}'); keel trains "
            f"on text and images only: use an entry without {'/'.join(media)} columns"
        )


def _check_stage(entry: dict, where: str, stage: str | None) -> None:
    """Ranking entries train dpo/orpo/simpo, kto_tag entries kto, the others pt and sft."""
    columns = entry.get("columns") if isinstance(entry.get("columns"), dict) else {}
    ranking, kto_tag = bool(entry.get("ranking")), columns.get("kto_tag")
    if ranking and kto_tag:
        raise DataError(
            f"{where} has both ranking: true and columns.kto_tag; an entry holds pairs "
            f"(ranking) or labelled samples (kto_tag): remove one"
        )
    if stage is None:
        return
    this_run = f"this run is train.stage {stage}"
    unit, sft = get_stage(stage).unit, spoken(stages_of("conversation"))
    if ranking and unit != "pair":
        raise DataError(
            f"{where} is preference data (ranking: true); it needs a preference stage: "
            f"train.stage {spoken(stages_of('pair'))} ({this_run})"
        )
    if kto_tag and unit != "sample":
        raise DataError(
            f"{where} is KTO data (columns.kto_tag: '{kto_tag}'); it needs the preference "
            f"stage train.stage {spoken(stages_of('sample'))} ({this_run})"
        )
    if unit == "pair" and not ranking:
        raise DataError(
            f'{where} is not preference data (no "ranking": true); train.stage {stage} '
            f'trains on pairs: use an entry with "ranking": true and columns chosen and '
            f"rejected, or train.stage {sft} for this one"
        )
    if unit == "sample" and not kto_tag:
        raise DataError(
            f"{where} has no columns.kto_tag; train.stage {stage} trains on samples labelled "
            f"true/false: name the label column in columns.kto_tag, or use train.stage {sft} "
            f"for this entry"
        )


def _unknown_key_notes(entry: dict, where: str) -> list[str]:
    """LLaMA-Factory ignores keys it does not know; so does keel, but it says so."""
    notes = []
    for key in entry:
        if key not in _ENTRY_KEYS:
            close = difflib.get_close_matches(key, _ENTRY_KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            notes.append(f"{where}: key '{key}' is not one LLaMA-Factory reads; ignored{hint}")
    return notes


def _hub_id(entry: dict, where: str) -> str | None:
    """The Hugging Face dataset id of an entry without a file_name (None: it has one);
    refuses an entry keel cannot read from anywhere."""
    if entry.get("file_name"):
        return None
    hub_id = entry.get("hf_hub_url")
    if not hub_id:
        hub = [k for k in _HUB_KEYS if entry.get(k)]
        source = f" ({hub[0]}: {entry[hub[0]]})" if hub else ""
        raise DataError(
            f"{where} has no file_name{source}; keel reads local files and Hugging Face Hub "
            f'datasets: download the data and add "file_name" to the entry, give its Hugging '
            f'Face id in "hf_hub_url", or list the file in data.datasets'
        )
    if not isinstance(hub_id, str) or not is_hub_id(hub_id):
        raise DataError(
            f"{where}: hf_hub_url must be a dataset id such as owner/name, got {hub_id!r}"
        )
    return hub_id


def _text(entry: dict, key: str, where: str) -> str | None:
    value = entry.get(key)
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {key} must be a string, got {value!r}")
    return value or None


def _local_path(entry: dict, dataset_dir: Path, where: str, notes: list[str]) -> Path:
    """The entry's local file or folder, with `folder` applied where it means something."""
    file_name = entry.get("file_name")
    hub = [k for k in _HUB_KEYS if entry.get(k)]
    if not isinstance(file_name, str):
        raise DataError(f"{where}: file_name must be a string, got {file_name!r}")
    if hub:  # parser.py: any hub key wins over file_name there
        notes.append(
            f"{where}: has both {hub[0]} and file_name; LLaMA-Factory would load "
            f"{entry[hub[0]]} and ignore file_name; keel reads the local file_name "
            f"'{file_name}'"
            + (f" (remove file_name to read {entry[hub[0]]})" if hub[0] == "hf_hub_url" else "")
        )
    path = dataset_dir / file_name
    if not path.exists():
        raise DataError(f"{where}: file_name '{file_name}' not found ({path})")
    folder, subset = entry.get("folder"), entry.get("subset")
    if folder and path.is_dir():
        # The hub meaning (data_dir: a folder inside the dataset). LLaMA-Factory passes
        # folder only to hub loads, but it cannot read a local folder holding subfolders
        # at all, so honouring it here changes no data it would load.
        if not (path / folder).is_dir():
            raise DataError(f"{where}: folder '{folder}' not found in {path}")
        path = path / folder
    elif folder:
        notes.append(
            f"{where}: folder '{folder}' is ignored: file_name is a file, and a folder "
            f"selects a part of a dataset folder or hub repository (as in LLaMA-Factory)"
        )
    if subset:
        notes.append(
            f"{where}: subset '{subset}' is ignored: a subset names a configuration of a hub "
            f"dataset; LLaMA-Factory reads a local file_name whole, and so does keel"
        )
    return path


def _num_samples(entry: dict, where: str) -> int | None:
    n = entry.get("num_samples")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise DataError(f"{where}: num_samples must be a whole number > 0, got {n!r}")
    return n


def _names(entry: dict, key: str, valid: tuple[str, ...], where: str) -> dict | None:
    """The entry's `columns` or `tags` as written (None when absent), checked."""
    given = entry.get(key)
    if given is None:
        return None
    if not isinstance(given, dict):
        raise DataError(f"{where}: {key} must be an object, got {type(given).__name__}")
    for name, value in given.items():
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise DataError(
                f"{where}: {key}.{name} is not a key LLaMA-Factory reads{hint}; valid: "
                f"{', '.join(valid)}"
            )
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: {key}.{name} must be a column name, got {value!r}")
    return given


def _lf_reading(entry: dict, where: str, stage: str | None):
    """(keel format, columns, tags) that read the entry as LLaMA-Factory does for `stage`."""
    formatting = entry.get("formatting", "alpaca")
    if formatting == "openai":
        raise DataError(
            f"{where}: formatting 'openai' is refused: LLaMA-Factory's converter for it adds "
            f"'detailed thinking off' to the system prompt of every sample, a convention of "
            f"one model family; write the entry as its data/README.md shows OpenAI-style data: "
            f'"formatting": "sharegpt" with tags role_tag: role, content_tag: content, '
            f"user_tag: user, assistant_tag: assistant, system_tag: system"
        )
    if formatting not in ("alpaca", "sharegpt"):
        raise DataError(
            f"{where}: formatting '{formatting}' is unknown; expected alpaca or sharegpt"
        )
    declared = _names(entry, "columns", LF_COLUMNS, where)
    columns = {
        k: (_LF_DEFAULT_COLUMNS if declared is None else declared).get(k) for k in COLUMN_KEYS
    }
    unit = get_stage(stage).unit if stage is not None else None
    if unit in ("pair", "sample"):
        _check_answer_columns(columns, formatting, where, unit)
    if formatting == "alpaca":
        return _alpaca_reading(columns, declared is None, where, unit)
    declared_tags = _names(entry, "tags", LF_TAGS, where)
    defaults = DEFAULT_TAGS["sharegpt"]
    tags = {k: (defaults if declared_tags is None else declared_tags).get(k) for k in LF_TAGS}
    unset = ["columns.messages"] if columns["messages"] is None else []
    unset += [
        f"tags.{k}"
        for k in ("role_tag", "content_tag", "user_tag", "assistant_tag")
        if tags[k] is None
    ]
    if unset:
        raise DataError(
            f"{where}: sharegpt data needs {', '.join(unset)}; an entry's tags replace "
            f"LLaMA-Factory's defaults (from/value/human/gpt), so name every tag it uses"
        )
    if unit == "text":
        raise DataError(
            f"{where} is sharegpt conversations: for train.stage {stage} LLaMA-Factory pretrains "
            f"on the first user message of each conversation only and drops the rest; keel "
            f"refuses rather than drop text silently: use train.stage sft, or a corpus entry "
            f'("columns": {{"prompt": "text"}}) for pretraining'
        )
    return "sharegpt", columns, tags


def _check_answer_columns(columns: dict, formatting: str, where: str, unit: str) -> None:
    """The columns a preference entry must name: chosen and rejected, or kto's answer."""
    if unit == "pair":
        missing = [f"columns.{k}" for k in ("chosen", "rejected") if columns[k] is None]
        if missing:
            raise DataError(
                f"{where} is ranking data but names no {' or '.join(missing)} (LLaMA-Factory "
                f"cannot read such an entry either); name the columns of the better and the "
                f"worse answer"
            )
    elif formatting == "alpaca" and columns["response"] is None:
        raise DataError(
            f"{where} names no columns.response: KTO needs the answer its kto_tag labels "
            f"(the last message, in sharegpt entries)"
        )


def _alpaca_reading(columns: dict, defaults: bool, where: str, unit: str | None):
    named = "LLaMA-Factory's defaults without columns" if defaults else "named in the entry"
    if columns["prompt"] is None:
        raise DataError(f"{where}: alpaca data needs columns.prompt (the instruction column)")
    if unit == "text":
        lost = {k: columns[k] for k in ("response", "system", "history") if columns[k]}
        if lost:
            shown = ", ".join(f"{k}: '{v}'" for k, v in lost.items())
            raise DataError(
                f"{where} is instruction data ({shown}, {named}): for train.stage pt "
                f"LLaMA-Factory pretrains on prompt and query only (on the first history "
                f"message instead when a row has history) and silently drops "
                f"{', '.join(lost)}; keel refuses rather than drop text: use train.stage sft, "
                f"or name only the text column(s) in the entry, e.g. "
                f'"columns": {{"prompt": "text"}}'
            )
        return "text", {"prompt": columns["prompt"], "query": columns["query"]}, {}
    if unit == "conversation" and columns["response"] is None:
        query = f", query '{columns['query']}'" if columns["query"] else ""
        raise DataError(
            f"{where} names no response column (columns: prompt '{columns['prompt']}'"
            f"{query}): that is how LLaMA-Factory declares a pretraining corpus, and it has "
            f"no answer to learn in SFT (LLaMA-Factory drops every such row); use "
            f"train.stage pt, or name the answer column in columns.response"
        )
    return "alpaca", columns, {}
