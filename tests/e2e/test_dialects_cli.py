"""Their configs as they are: each LLaMA-Factory and Axolotl example config in
tests/fixtures/dialects/ (their own files, the model and data swapped for "{model}" and
"{data}", their Qwen chat templates for the tiny Llama's) converts to a keel config that
`keel validate` accepts, and `keel train` of the original trains 2 steps on the tiny model,
printing the mapping report."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml
from cli_support import ROOT, keel_in_process
from conftest import QA

from keel.config import load_config

FIXTURES = ROOT / "tests" / "fixtures" / "dialects"
CONFIGS = sorted(p for p in FIXTURES.glob("*/*") if p.suffix in (".yaml", ".yml"))
# What a test run does not take from their configs: the tiny model trains 2 steps in fp32 on
# one thread of a busy machine (bf16: auto measures the CPU's bf16 speed first, 6 s),
# tokenizes its ten rows in this process (not their 16 workers), logs each step, and uses
# plain AdamW (the 8-bit one compiles for 15 s on a CPU first; tests/unit/test_optim_lowbit.py
# covers it)
CHEAP = ["train.precision=fp32", "train.threads=1", "data.num_proc=1"]
RUN = [*CHEAP, "train.max_steps=2", "train.optimizer=adamw", "output.log_every=1"]


def test_there_are_fixtures_of_both_dialects():
    assert {p.parent.name for p in CONFIGS} == {"llamafactory", "axolotl"}


# LLaMA-Factory's fixtures name a dataset by "{dataset}": the one of the tiny data folder
# that their stage reads
LLAMAFACTORY_DATASETS = {
    "pt": "text_mini",
    "sft": "alpaca_mini",
    "rm": "dpo_mini",
    "dpo": "dpo_mini",
    "kto": "kto_mini",
}


@pytest.fixture(scope="module")
def filled(tiny_model_dir, tmp_path_factory):
    """The fixture folders copied with the placeholders filled in: {dialect/name: path}."""
    root = tmp_path_factory.mktemp("dialects")
    data = _tiny_data(root / "data")
    for folder in {p.parent for p in CONFIGS}:
        shutil.copytree(folder, root / folder.name)
    found = {}
    for path in CONFIGS:
        copy = root / path.parent.name / path.name
        text = copy.read_text().replace("{model}", str(tiny_model_dir))
        copy.write_text(_fill_data(text, path.parent.name, data))
        found[f"{path.parent.name}/{path.name}"] = copy
    return found


# The tiny model is a Llama: their Qwen templates would be refused on it (keel renders the
# model's own template, not theirs), so the fixtures name the Llama family's template instead
LLAMA_TEMPLATE = re.compile(r"^(template|chat_template): \S+$", re.MULTILINE)


def _fill_data(text: str, dialect: str, data) -> str:
    text = LLAMA_TEMPLATE.sub(r"\1: llama3", text)
    raw = yaml.safe_load(text)
    if dialect == "llamafactory":  # {data}: a dataset_info.json folder, {dataset}: a name
        text = text.replace("{dataset}", LLAMAFACTORY_DATASETS[raw["stage"]])
        return text.replace("{data}", str(data))
    kind = {"dpo": "pairs.jsonl", "kto": "kto.jsonl"}.get(raw.get("rl"), "alpaca.jsonl")
    if raw.get("reward_model"):  # bradley_terry.chat_template: system/input/chosen/rejected
        kind = "bradley_terry.jsonl"
    if raw["datasets"][0]["type"] == "chat_template":  # FineTome's ShareGPT-named messages
        kind = "conversations.jsonl"
    return text.replace("{data}", str(data / kind))  # Axolotl: {data} is a data file


def _tiny_data(folder):
    """A few rows of each kind their configs read: LLaMA-Factory's dataset_info.json folder
    of the shipped examples plus a text corpus, and Axolotl's alpaca, conversation (from/value,
    human/gpt), DPO, KTO and Bradley-Terry (reward model) files."""
    shutil.copytree(ROOT / "examples" / "data" / "llamafactory", folder)
    info = json.loads((folder / "dataset_info.json").read_text())
    info["text_mini"] = {"file_name": "text_mini.jsonl", "columns": {"prompt": "text"}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    _jsonl(folder / "text_mini.jsonl", [{"text": f"{q} {a}"} for q, a in QA])
    _jsonl(folder / "alpaca.jsonl", [{"instruction": q, "input": "", "output": a} for q, a in QA])
    turns = [[{"from": "human", "value": q}, {"from": "gpt", "value": a}] for q, a in QA]
    _jsonl(folder / "conversations.jsonl", [{"conversations": t} for t in turns])
    _jsonl(
        folder / "pairs.jsonl",
        [
            {
                "conversation": [{"role": "user", "content": q}],
                "chosen": {"role": "assistant", "content": a},
                "rejected": {"role": "assistant", "content": "No."},
            }
            for q, a in QA
        ],
    )
    shutil.copy(ROOT / "examples" / "data" / "preference" / "kto.jsonl", folder / "kto.jsonl")
    _jsonl(
        folder / "bradley_terry.jsonl",  # the columns of argilla/distilabel-intel-orca-dpo-pairs
        [
            {
                "system": "" if i % 2 else "Answer briefly.",
                "input": q,
                "chosen": a,
                "rejected": "No.",
            }
            for i, (q, a) in enumerate(QA)
        ],
    )
    return folder


def _jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _ids():
    return [f"{p.parent.name}/{p.name}" for p in CONFIGS]


@pytest.mark.parametrize("name", _ids())
def test_their_config_converts_and_validates(name, filled, tmp_path):
    their, out = filled[name], tmp_path / "keel.yaml"
    converted = keel_in_process("convert", str(their), "--out", str(out), cwd=their.parent)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert out.read_text().startswith("# ")
    load_config(out)  # the file as written, before the cheap settings replace some values
    checked = keel_in_process(
        "validate", str(out), f"output.dir={tmp_path / 'out'}", *CHEAP, cwd=their.parent
    )
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "config and data are valid" in checked.stdout


@pytest.mark.parametrize("name", _ids())
def test_their_config_trains_two_steps(name, filled, tmp_path):
    their, out = filled[name], tmp_path / "out"
    result = keel_in_process(
        "train",
        str(their),
        f"output.dir={out}",
        f"model.cache_dir={tmp_path / 'cache'}",
        *RUN,
        cwd=their.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    dialect = "LLaMA-Factory" if name.startswith("llamafactory") else "Axolotl"
    assert f"{dialect} config translated to keel" in result.stdout + result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_validate_of_their_config_prints_the_mapping_report(filled, tmp_path):
    their = filled["axolotl/llama-3-lora-1b.yml"]
    result = keel_in_process("validate", str(their), f"output.dir={tmp_path / 'out'}", *CHEAP)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Axolotl config translated to keel" in result.stdout
    assert "lora_r -> method.lora.r" in result.stdout
    assert "config and data are valid" in result.stdout


def test_an_unknown_llamafactory_key_is_refused_naming_it(filled, tmp_path):
    their = next(p for name, p in filled.items() if name.startswith("llamafactory/"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(their.read_text() + "\nlora_rnak: 8\n")
    result = keel_in_process("train", str(bad), f"output.dir={tmp_path / 'out'}", *RUN)
    assert result.returncode == 2
    assert "lora_rnak" in result.stderr and "refused" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_a_template_of_another_model_family_is_refused_naming_the_fix(filled, tmp_path):
    their = filled["llamafactory/qwen3_lora_sft.yaml"]
    bad = tmp_path / "qwen_template.yaml"
    bad.write_text(their.read_text().replace("template: llama3", "template: qwen3_nothink"))
    result = keel_in_process("train", str(bad), f"output.dir={tmp_path / 'out'}", *RUN)
    assert result.returncode == 2
    assert (
        f"template ({bad}:" in result.stderr and "is refused: qwen3_nothink is the" in result.stderr
    )
    assert "is a llama model" in result.stderr and "leave template out" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_their_own_jinja_template_trains_and_is_saved_with_the_model(filled, tmp_path):
    """Axolotl's `chat_template: jinja` with the template in `chat_template_jinja`: keel
    renders the rows with it and the trained model's tokenizer carries it (chat and serve
    then prompt as training did)."""
    text = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    their = filled["axolotl/llama-3-fft-8b-liger-fsdp.yaml"]
    raw = yaml.safe_load(their.read_text())
    raw["chat_template"], raw["chat_template_jinja"] = "jinja", text
    own = their.with_name("own-template.yaml")
    own.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    result = keel_in_process("train", str(own), f"output.dir={out}", *RUN, cwd=own.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "chat_template_jinja -> data.template" in printed and "template inline" in printed
    saved = out / "chat_template.jinja"
    found = saved.read_text() if saved.is_file() else None
    if found is None:  # older transformers keep it in tokenizer_config.json
        found = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    assert found == text
