"""keel predict: each row's prompt answered as keel chat answers it (the same rendering and
greedy tokens, with the engine's batching), scored against the row's answer, written whole
into a new folder; LLaMA-Factory's predict config and keel's run config taken as they are;
bad rows and full folders refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import keel_in_process
from conftest import build_tiny_tokenizer
from serve_support import random_lora, varied_tiny_model, write_model_dir

from keel.config.dialects.commands import translate_command
from keel.infer.generate import generate_reply
from keel.infer.text_metrics import score_answers
from keel.models import load_for_inference

QUIET = dict(log=lambda message: None)
TOKENS = 10
CONVERSATIONS = [
    [{"role": "user", "content": "Who are you?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
    [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 3 times 4?"},
    ],
    [{"role": "user", "content": "Name a color."}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("predict")
    tokenizer = build_tiny_tokenizer()
    base = varied_tiny_model(len(tokenizer))
    model_dir = write_model_dir(base, tokenizer, root / "model")
    return {"model": model_dir, "lora": random_lora(base, root / "lora", seed=1)}


def _replies(model_dir: Path, adapter: Path | None = None) -> list[str]:
    """keel chat's greedy reply to each conversation (transformers' generate)."""
    model, tokenizer = load_for_inference(str(model_dir), adapter, cache_dir="unused", **QUIET)
    return [
        generate_reply(model, tokenizer, messages, max_new_tokens=TOKENS)
        for messages in CONVERSATIONS
    ]


def _write_rows(path: Path, labels: list[str]) -> Path:
    rows = [
        {"messages": [*messages, {"role": "assistant", "content": label}]}
        for messages, label in zip(CONVERSATIONS, labels)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _predict(tmp_path: Path, *args: str):
    done = keel_in_process("predict", *args, cwd=tmp_path)
    return done


def _read(out: Path) -> tuple[list[dict], dict]:
    lines = (out / "generated_predictions.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], json.loads(
        (out / "predict_results.json").read_text()
    )


@pytest.mark.parametrize("with_adapter", [False, True])
def test_answers_are_keel_chats_and_scored_against_the_labels(folders, tmp_path, with_adapter):
    adapter = folders["lora"] if with_adapter else None
    replies = _replies(folders["model"], adapter)
    assert len(set(replies)) == len(replies)  # varied: a wrong prompt would show
    labels = [replies[0], replies[1], "Something else.", replies[3][:-2]]
    data = _write_rows(tmp_path / "rows.jsonl", labels)
    flags = ["--adapter", str(adapter)] if adapter else []
    done = _predict(
        tmp_path,
        *("--model", str(folders["model"]), "--data", str(data), "--out", "out", *flags),
        *("--max-new-tokens", str(TOKENS), "--max-batch-size", "2"),
    )
    assert done.returncode == 0, done.stderr
    records, results = _read(tmp_path / "out")
    assert [r["predict"] for r in records] == replies
    assert [r["label"] for r in records] == labels
    assert [r["source"] for r in records] == [f"{data.name} row {i}" for i in (1, 2, 3, 4)]
    assert records[1]["prompt"].startswith("<|im_start|>system\nAnswer in French.")
    assert "And 3 times 4?" in records[2]["prompt"] and records[2]["prompt"].endswith(
        "<|im_start|>assistant\n"
    )
    assert results["predict_exact_match"] == 50.0
    assert results["predict_samples"] == 4 and results["sampling"]["temperature"] == 0.0
    expected = score_answers(zip(replies, labels))
    assert {k: results[f"predict_{k}"] for k in expected} == expected
    assert "predicted 4 answers" in done.stdout


def test_sampling_is_seeded_per_row(folders, tmp_path):
    data = _write_rows(tmp_path / "rows.jsonl", ["a", "b", "c", "d"])
    common = ("--model", str(folders["model"]), "--data", str(data), "--temperature", "1")

    def answers(out: str, seed: str) -> list[str]:
        assert _predict(tmp_path, *common, "--out", out, "--seed", seed).returncode == 0
        return [r["predict"] for r in _read(tmp_path / out)[0]]

    first = answers("one", "7")
    assert answers("two", "7") == first
    assert answers("three", "8") != first


def test_refusals_leave_the_folder_alone(folders, tmp_path):
    model = ("--model", str(folders["model"]))
    good = _write_rows(tmp_path / "rows.jsonl", ["a", "b", "c", "d"])
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    done = _predict(tmp_path, *model, "--data", str(good), "--out", str(full))
    assert done.returncode == 2 and "is not empty; keel never overwrites it" in done.stderr
    assert [p.name for p in full.iterdir()] == ["mine.txt"]

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain text"}) + "\n")
    done = _predict(tmp_path, *model, "--data", str(text), "--out", "t")
    assert done.returncode == 2 and "holds no prompt to answer" in done.stderr

    bad = tmp_path / "bad.jsonl"
    rows = good.read_text().splitlines()
    misordered = {"messages": [{"role": "assistant", "content": "Hi"}]}
    bad.write_text("\n".join([rows[0], json.dumps(misordered), rows[3]]) + "\n")
    done = _predict(tmp_path, *model, "--data", str(bad), "--out", "b")
    said = "message 1 is assistant, expected user"
    assert done.returncode == 2 and f"{bad.name} row 2" in done.stderr and said in done.stderr
    assert not (tmp_path / "b").exists()
    done = _predict(tmp_path, *model, "--data", str(bad), "--out", "b", "--skip-invalid")
    assert done.returncode == 0 and "skipped 1 invalid row" in done.stdout
    assert _read(tmp_path / "b")[1]["predict_samples"] == 2

    done = _predict(tmp_path, *model, "--data", str(good), "--out", "c", "--cutoff-len", "40")
    assert done.returncode == 2 and "longer than cutoff_len=40" in done.stderr
    done = _predict(
        tmp_path, *model, "--data", str(good), "--out", "c", "--cutoff-len", "40", "--skip-long"
    )
    kept = _read(tmp_path / "c")[1]["predict_samples"]
    assert done.returncode == 0 and 0 < kept < 4
    # the tiny model's positions (512), not a larger cutoff_len, bound a prompt
    long = tmp_path / "long.jsonl"
    turns = [
        {"role": "user", "content": "hello world " * 400},
        {"role": "assistant", "content": "x"},
    ]
    long.write_text(json.dumps({"messages": turns}) + "\n")
    done = _predict(tmp_path, *model, "--data", str(long), "--out", "d", "--cutoff-len", "4096")
    said = "1 prompt(s) with no room to answer in the model's context of 512 tokens"
    assert done.returncode == 2 and said in done.stderr, done.stderr

    for flags, said in (
        ((), "keel predict needs --data"),
        (("--data", str(good), "--top-p", "0"), "--top-p 0"),
        (("--data", str(good), "--max-new-tokens", "0"), "--max-new-tokens 0"),
    ):
        done = _predict(tmp_path, *model, "--out", "z", *flags)
        assert done.returncode == 2 and said in done.stderr, done.stderr


def test_prompts_without_answers_are_answered_not_scored(folders, tmp_path):
    replies = _replies(folders["model"])
    chat = tmp_path / "chat.jsonl"  # conversations, two of them ending with the user's turn
    answered = [*CONVERSATIONS[1], {"role": "assistant", "content": replies[1]}]
    rows = [{"messages": CONVERSATIONS[0]}, {"messages": answered}, {"messages": CONVERSATIONS[2]}]
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows))
    alpaca = tmp_path / "alpaca.json"  # alpaca without outputs
    alpaca.write_text(json.dumps([{"instruction": CONVERSATIONS[3][0]["content"]}]))
    trl = tmp_path / "trl.jsonl"  # TRL's prompt-only rows, messages and text
    trl_rows = [{"prompt": CONVERSATIONS[0]}, {"prompt": "0 1 2"}]
    trl.write_text("".join(json.dumps(row) + "\n" for row in trl_rows))
    flags = ["--model", str(folders["model"]), "--max-new-tokens", str(TOKENS)]
    for path in (chat, alpaca, trl):
        flags += ["--data", str(path)]
    done = _predict(tmp_path, *flags, "--out", "out")
    assert done.returncode == 0, done.stderr
    records, results = _read(tmp_path / "out")
    answers = [r["predict"] for r in records]
    assert answers[:5] == [replies[0], replies[1], replies[2], replies[3], replies[0]]
    assert records[5]["prompt"] == "0 1 2" and answers[5]  # continued as it is
    assert [r["label"] for r in records] == [None, replies[1], None, None, None, None]
    assert results["predict_samples"] == 6 and results["predict_labelled"] == 1
    assert results["predict_exact_match"] == 100.0 and results["predict_bleu-4"] == 100.0
    assert "5 without a label, not scored" in done.stdout


# examples/extras/nlg_eval/llama3_lora_predict.yaml's keys, on local files
def _llamafactory_predict(model: Path, adapter: Path) -> dict:
    return {
        "model_name_or_path": str(model),
        "adapter_name_or_path": str(adapter),
        "trust_remote_code": True,
        "stage": "sft",
        "do_predict": True,
        "finetuning_type": "lora",
        "eval_dataset": "qa,qa_too",
        "cutoff_len": 2048,
        "max_samples": 3,
        "overwrite_cache": True,
        "preprocessing_num_workers": 16,
        "dataloader_num_workers": 4,
        "output_dir": "saves/predict",
        "overwrite_output_dir": True,
        "report_to": "none",
        "per_device_eval_batch_size": 1,
        "predict_with_generate": True,
        "ddp_timeout": 180000000,
    }


def test_llamafactory_predict_config_as_it_is(folders, tmp_path):
    raw = _llamafactory_predict(folders["model"], folders["lora"])
    translation = translate_command(raw, Path("predict.yaml"), "predict")
    assert translation.refused() == []
    assert translation.config == {
        "model": str(folders["model"]),
        "adapter": str(folders["lora"]),
        "data": [{"path": "qa"}, {"path": "qa_too"}],
        "dataset_dir": "data",
        "cutoff_len": 2048,
        "max_samples": 3,
        "out": "saves/predict",
        "max_new_tokens": 1024,  # their sampling defaults
        "temperature": 0.95,
        "top_p": 0.7,
    }
    for key, value, said in (
        ("predict_with_generate", False, "reports the loss alone"),
        ("do_train", True, "keel predict only predicts"),
        ("stage", "dpo", "stage sft"),
    ):
        refused = translate_command({**raw, key: value}, Path("p.yaml"), "predict").refused()
        assert [f.key for f in refused] == [key] and said in refused[0].why

    data = tmp_path / "data"
    data.mkdir()
    alpaca = [{"instruction": m[-1]["content"], "output": "x"} for m in CONVERSATIONS]
    (data / "qa.json").write_text(json.dumps(alpaca))
    (data / "qa_too.json").write_text(json.dumps(alpaca[:2]))
    info = {"qa": {"file_name": "qa.json"}, "qa_too": {"file_name": "qa_too.json"}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    config = tmp_path / "predict.yaml"
    raw |= {"do_sample": False, "max_new_tokens": 6}
    config.write_text(json.dumps(raw))  # YAML reads JSON
    done = _predict(tmp_path, str(config))
    assert done.returncode == 0, done.stderr
    records, results = _read(tmp_path / "saves" / "predict")
    # max_samples 3 of qa's 4 rows, then qa_too's 2
    assert [r["source"].split(" row ")[1] for r in records] == ["1", "2", "3", "1", "2"]
    assert results["adapter"] == str(folders["lora"])
    assert results["sampling"] | {"seed": 0} == {
        "max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "seed": 0
    }  # fmt: skip


def test_keel_run_config_answers_its_evaluation_data(folders, tmp_path):
    import shutil

    shutil.copytree(folders["model"], tmp_path / "run")  # what `keel train` wrote
    held_out = _write_rows(tmp_path / "held_out.jsonl", ["a", "b", "c", "d"])
    config = {
        "model": {"path": str(folders["model"])},
        "data": {
            "datasets": [{"path": "train.jsonl"}],
            "eval_datasets": [{"path": "held_out.jsonl"}],
            "cutoff_len": 512,
        },
        "output": {"dir": "run"},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    done = _predict(tmp_path, "run.yaml", "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr
    records, _ = _read(tmp_path / "run" / "predict")
    assert [r["source"] for r in records] == [f"{held_out.name} row {i}" for i in (1, 2, 3, 4)]
    # --data instead of its evaluation data; the config's cutoff_len still applies
    done = _predict(
        tmp_path, "run.yaml", "--data", "held_out.jsonl", "--out", "other", "--cutoff-len", "40"
    )
    assert done.returncode == 2 and "longer than cutoff_len=40" in done.stderr
    config["data"].pop("eval_datasets")
    (tmp_path / "bare.yaml").write_text(json.dumps(config))
    done = _predict(tmp_path, "bare.yaml", "--out", "x")
    assert done.returncode == 2 and "bare.yaml has no data.eval_datasets" in done.stderr


def test_rows_with_images_are_answered_as_keel_chat_answers_them(folders, tmp_path):
    import torch
    from vlm_support import (
        build_qwen2_vl_image_processor,
        build_qwen2_vl_tokenizer,
        build_tiny_qwen2_vl,
        make_image,
        save_model_folder,
        write_image,
    )

    from keel.infer.generate import ChatImages
    from keel.infer.vision import vision_of

    tokenizer = build_qwen2_vl_tokenizer()
    model = build_tiny_qwen2_vl(tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger weights: greedy answers vary with the image
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    folder = save_model_folder(tmp_path / "vlm", model, tokenizer, build_qwen2_vl_image_processor())
    for seed in (1, 2):
        write_image(tmp_path / f"img{seed}.png", seed=seed)
    question = "<image>What is in the picture?"
    rows = [
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "x"}],
         "images": [f"img{seed}.png"]}
        for seed in (1, 2)
    ] + [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "y"}]}]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ("--model", str(folder), "--data", str(data), "--max-new-tokens", str(TOKENS))
    done = _predict(tmp_path, *flags, "--out", "out")
    assert done.returncode == 0, done.stderr
    records, _ = _read(tmp_path / "out")

    loaded, loaded_tokenizer = load_for_inference(str(folder), None, cache_dir="unused", **QUIET)
    vision = vision_of(loaded, **QUIET)
    expected = [
        generate_reply(
            loaded,
            loaded_tokenizer,
            [{"role": "user", "content": question}],
            images=ChatImages((make_image(seed),), vision),
            max_new_tokens=TOKENS,
        )
        for seed in (1, 2)
    ]
    assert [r["predict"] for r in records[:2]] == expected and expected[0] != expected[1]
    assert records[0]["prompt"].count("<image>") == 1  # the placeholder, not its tokens

    done = _predict(tmp_path, "--model", str(folders["model"]), "--data", str(data), "--out", "t")
    assert done.returncode == 2 and "row 1: has 1 image(s), but the model is a text model" in (
        done.stderr
    )


def test_keel_train_on_their_predict_config_names_keel_predict(folders):
    from keel.config.dialects import translate

    raw = _llamafactory_predict(folders["model"], folders["lora"])
    refused = {f.key: f.why for f in translate(raw, Path("predict.yaml")).refused()}
    assert "keel predict takes this file as it is" in refused["do_predict"]


def test_tool_calling_rows_render_their_tools_or_are_refused(folders, tmp_path):
    from importlib import resources

    from conftest import openai_weather_turns

    qwen = resources.files("trl").joinpath("chat_templates/qwen2_5.jinja")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    turns = openai_weather_turns("Paris", "sunny")
    row = {"messages": [*turns, {"role": "assistant", "content": "Sunny."}], "tools": tools}
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(row) + "\n")
    tokenizer = build_tiny_tokenizer()
    model = varied_tiny_model(len(tokenizer))
    model.config.max_position_embeddings = 1024  # Qwen's tool prompt is ~570 tiny tokens
    model_dir = write_model_dir(model, tokenizer, tmp_path / "model")
    flags = ["--model", str(model_dir), "--data", str(data), "--max-new-tokens", "4"]
    done = _predict(tmp_path, *flags, "--out", "plain")  # the tiny model's ChatML: no tools
    assert done.returncode == 2 and "does not render tools" in done.stderr
    done = _predict(tmp_path, *flags, "--out", "out", "--template", str(qwen))
    assert done.returncode == 0, done.stderr
    record = _read(tmp_path / "out")[0][0]
    turns[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # parsed, as TRL's
    turns[1]["content"] = ""
    expected = tokenizer.apply_chat_template(
        turns, tools=tools, chat_template=qwen.read_text(), add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    assert record["prompt"] == expected and record["label"] == "Sunny."
    assert '"name": "get_weather"' in record["prompt"] and "sunny" in record["prompt"]


def test_an_interrupted_run_answers_only_the_rest(folders, tmp_path, monkeypatch):
    import keel.infer.batch_generate as batch_generate

    rows = [
        {"messages": [{"role": "user", "content": f"{q} {k}"}, {"role": "assistant", "content": "a"}]}
        for k in range(5) for q in ("Who are you?", "Name a color.", "Add 2 and 3.", "Hi")
    ]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--model", str(folders["model"]), "--data", str(data), "--temperature", "1"]
    flags += ["--max-batch-size", "2", "--max-new-tokens", "6"]  # 20 rows in chunks of 8
    real, calls = batch_generate.generate_groups, []

    def counted(model, tokenizer, requests, *args, stop_at=None, **kwargs):
        calls.append(len(requests))
        if len(calls) == stop_at:
            raise KeyboardInterrupt  # Ctrl-C, a preemption, a crash: after the first chunk
        return real(model, tokenizer, requests, *args, **kwargs)

    def run(out: str, *more: str, stop_at=None):
        calls.clear()
        monkeypatch.setattr(
            batch_generate,
            "generate_groups",
            lambda *a, **k: counted(*a, stop_at=stop_at, **k),
        )
        return _predict(tmp_path, *flags, *more, "--out", out)

    assert run("whole").returncode == 0 and calls == [8, 8, 4]
    assert run("out", stop_at=2).returncode == 130 and not (tmp_path / "out").exists()
    progress = tmp_path / ".out.predict-progress-0-of-1.jsonl"
    assert len(progress.read_text().splitlines()) == 2  # its fingerprint, the first chunk
    with open(progress, "a") as f:
        f.write("[[8, [1, 2")  # a line torn by a kill mid-write
    done = run("out")
    assert done.returncode == 0, done.stderr
    assert calls == [8, 4] and "resuming: 8 of 20 rows answered before" in done.stdout
    assert _read(tmp_path / "out")[0] == _read(tmp_path / "whole")[0] and not progress.exists()

    # another request (another seed) does not take the answers of this one
    assert run("other", stop_at=2).returncode == 130
    done = run("other", "--seed", "5")
    assert done.returncode == 0 and calls == [8, 8, 4] and "starting over" in done.stdout
