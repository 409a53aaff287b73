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
import torch
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


def test_their_unfrozen_parameters_train_only_what_they_match(filled, tiny_model_dir, tmp_path):
    """Axolotl's full fine-tuning with unfrozen_parameters: the matched parameters (the last
    layer, and the head tied to the embeddings) move, every other one stays the base's."""
    from safetensors.torch import load_file

    their = filled["axolotl/llama-3-fft-8b.yaml"]
    raw = yaml.safe_load(their.read_text())
    raw["unfrozen_parameters"] = ["model.layers.1.*", "lm_head"]
    partial = their.with_name("unfrozen.yaml")
    partial.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    result = keel_in_process("train", str(partial), f"output.dir={out}", *RUN, cwd=their.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unfrozen_parameters -> method.freeze.trainable_params" in result.stdout + result.stderr
    base, trained = (
        load_file(tiny_model_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    moved = {name for name in base if not torch.equal(base[name], trained[name])}
    want = {n for n in base if n.startswith("model.layers.1.")} | {"model.embed_tokens.weight"}
    assert moved == want


def test_their_eval_dataset_is_evaluated_apart_from_the_training_data(filled, tmp_path):
    """The eval block their examples ship commented out, switched on with eval_dataset (a
    dataset of its own, not val_size): keel prepares it as evaluation data and reports its
    loss."""
    their = filled["llamafactory/qwen3_lora_sft.yaml"]
    text = their.read_text().replace("# eval_dataset: alpaca_en_demo", "eval_dataset: chat_mini")
    for key in ("per_device_eval_batch_size", "eval_strategy", "eval_steps"):
        text = text.replace(f"# {key}:", f"{key}:")
    evaluated = their.with_name("with_eval.yaml")
    evaluated.write_text(text)
    out = tmp_path / "out"
    result = keel_in_process("train", str(evaluated), f"output.dir={out}", *RUN, cwd=their.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "eval_dataset -> data.eval_datasets" in printed
    assert "chat_mini.json (eval)" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "eval_loss" in r] == [2]


# Their quickstarts after training: LLaMA-Factory's `chat examples/inference/X.yaml` and
# `export examples/merge_lora/X.yaml` (the shape of their files, the paths swapped for the
# tiny model and the run's output), Axolotl's inference and merge-lora with the training
# config itself
LF_INFERENCE = """model_name_or_path: {model}
adapter_name_or_path: {adapter}
template: llama3
infer_backend: huggingface  # choices: [huggingface, vllm, sglang, ktransformers]
trust_remote_code: true
"""
LF_MERGE = """### Note: DO NOT use quantized model or quantization_bit when merging lora adapters

### model
model_name_or_path: {model}
adapter_name_or_path: {adapter}
template: llama3
trust_remote_code: true

### export
export_dir: {out}
export_size: 5
export_device: cpu  # choices: [cpu, auto]
export_legacy_format: false
"""


@pytest.fixture(scope="module")
def lf_trained(filled, tiny_model_dir, tmp_path_factory):
    """The LLaMA-Factory LoRA example trained 2 steps: its output folder."""
    their = filled["llamafactory/qwen3_lora_sft.yaml"]
    out = tmp_path_factory.mktemp("lf") / "saves"
    result = keel_in_process("train", str(their), f"output.dir={out}", *RUN, cwd=their.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_their_chat_config_chats_as_the_flags_would(lf_trained, tiny_model_dir, tmp_path):
    inference = tmp_path / "qwen3_lora_sft.yaml"
    inference.write_text(LF_INFERENCE.format(model=tiny_model_dir, adapter=lf_trained))
    greedy = ("do_sample=false", "max_new_tokens=6")  # their key=value settings
    theirs = keel_in_process("chat", str(inference), "--prompt", "Hello", *greedy)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert "LLaMA-Factory config translated to keel" in theirs.stderr
    assert "adapter_name_or_path -> --adapter" in theirs.stderr
    assert "do_sample -> --temperature  (false: greedy decoding)" in theirs.stderr
    flags = ("--model", str(tiny_model_dir), "--adapter", str(lf_trained), "--max-new-tokens", "6")
    ours = keel_in_process("chat", *flags, "--prompt", "Hello")
    assert ours.returncode == 0 and theirs.stdout == ours.stdout and ours.stdout.strip()


def test_their_export_config_merges_as_the_flags_would(lf_trained, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    merge = tmp_path / "merge.yaml"
    merge.write_text(LF_MERGE.format(model=tiny_model_dir, adapter=lf_trained, out=tmp_path / "m"))
    theirs = keel_in_process("export", str(merge))
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert "export_size -> --max-shard-size" in theirs.stderr
    flags = ("--model", str(tiny_model_dir), "--adapter", str(lf_trained))
    ours = keel_in_process("export", *flags, "--out", str(tmp_path / "ours"))
    assert ours.returncode == 0, ours.stderr[-3000:]
    got, want = (
        load_file(tmp_path / "m" / "model.safetensors"),
        load_file(tmp_path / "ours" / "model.safetensors"),
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_their_refused_chat_settings_stop_before_loading(tiny_model_dir, tmp_path):
    inference = tmp_path / "bad.yaml"
    text = LF_INFERENCE.format(model=tiny_model_dir, adapter="a,b")
    inference.write_text(text.replace("huggingface  #", "sglang  #") + "top_k: 5\nlora_rnak: 8\n")
    result = keel_in_process("chat", str(inference), "--prompt", "Hello")
    assert result.returncode == 2
    for key in ("adapter_name_or_path", "infer_backend", "top_k", "lora_rnak"):
        assert f"{key} (LLaMA-Factory) is refused" in result.stderr, key
    assert "Traceback" not in result.stderr and not result.stdout


def test_axolotl_merge_and_chat_take_their_training_config(filled, tmp_path):
    """`keel export their.yml` merges what it trained into output_dir/merged (where axolotl
    merge-lora writes), and `keel chat their.yml` chats with the adapter on base_model."""
    their = filled["axolotl/llama-3-lora-1b.yml"]
    raw = yaml.safe_load(their.read_text())
    raw["output_dir"] = str(tmp_path / "lora-out")
    config = tmp_path / "lora-1b.yml"
    config.write_text(yaml.safe_dump(raw))
    trained = keel_in_process("train", str(config), *RUN, cwd=their.parent)
    assert trained.returncode == 0, trained.stderr[-3000:]
    merged = keel_in_process("export", str(config), cwd=their.parent)
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert "output_dir -> --adapter  (the trained adapter)" in merged.stderr
    assert (tmp_path / "lora-out" / "merged" / "model.safetensors").is_file()
    chat = ("chat", str(config), "--prompt", "Hi", "--max-new-tokens", "4")
    answered = keel_in_process(*chat, cwd=their.parent)
    assert answered.returncode == 0 and answered.stdout.strip(), answered.stderr[-3000:]


def test_keels_own_run_config_chats_with_what_it_trained(lf_trained, tmp_path):
    """`keel chat run.yaml` after `keel train run.yaml`: its output.dir is the model."""
    run = tmp_path / "run.yaml"
    run.write_text(
        yaml.safe_dump(
            {
                "model": {"path": "bundled:smollm2-135m-instruct"},
                "data": {"datasets": ["moved-since.jsonl"]},  # not read: chat needs no data
                "output": {"dir": str(lf_trained)},
            }
        )
    )
    theirs = keel_in_process("chat", str(run), "--prompt", "Hello", "--max-new-tokens", "6")
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert f"--model {lf_trained} (its output.dir)" in theirs.stderr
    ours = keel_in_process(
        "chat", "--model", str(lf_trained), "--prompt", "Hello", "--max-new-tokens", "6"
    )
    assert theirs.stdout == ours.stdout and ours.stdout.strip()
