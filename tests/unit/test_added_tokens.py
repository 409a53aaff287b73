"""model.add_tokens / model.add_special_tokens: the tokenizer, the embedding rows they need
(starting at the mean of the known rows, whole or sharded), what then trains, the plan, and
every way the result leaves: adapter, chat loading, merged export, checkpoint export."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_tokenizer
from safetensors import safe_open

from keel.config import load_config
from keel.config.schema import ModelConfig
from keel.errors import ConfigError
from keel.export import ExportRequest, export_model
from keel.models.adapters import apply_method, count_parameters, load_for_inference
from keel.models.materialize import (
    Starts,
    allocate,
    build_empty_model,
    fill_weights,
    init_computed_buffers,
)
from keel.models.vocabulary import (
    AddedTokens,
    add_configured_tokens,
    configured_tokens,
    grow_vocabulary,
    mean_start,
    with_trained_embeddings,
)

VOCAB = 320  # the tiny tokenizer's (tests/conftest.py)
# <|im_end|> is the tiny tokenizer's own: it stays as it is
TOKENS = {"add_tokens": ["<think>"], "add_special_tokens": ["<tool>", "<|im_end|>"]}
ASKED = ModelConfig(path="unused", **TOKENS)


def quiet(_message):
    pass


def test_the_tokenizer_gains_only_the_new_tokens():
    tokenizer = build_tiny_tokenizer()
    text = "Hi <|im_end|> there"
    before = tokenizer(text)["input_ids"]
    added = add_configured_tokens(tokenizer, ASKED)
    assert added == AddedTokens(new_ids=(VOCAB, VOCAB + 1), known=VOCAB, size=VOCAB + 2)
    think, tool = tokenizer.convert_tokens_to_ids(["<think>", "<tool>"])
    assert {think, tool} == {VOCAB, VOCAB + 1}
    ids = tokenizer("a<think>b<tool>c")["input_ids"]
    assert think in ids and tool in ids  # each one token, never split
    shown = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<think>" in shown and "<tool>" not in shown  # plain kept, special dropped
    assert tokenizer(text)["input_ids"] == before  # a token it had encodes as before
    again = build_tiny_tokenizer()
    assert add_configured_tokens(again, ModelConfig(path="x", add_tokens=["<|im_end|>"])) is None
    assert len(again) == VOCAB


def test_new_rows_start_at_the_mean_of_the_known_tokens_rows():
    stored = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    stored[5] = 1000.0  # a padding row past the tokenizer (as Qwen's): not a known token
    added = AddedTokens(new_ids=(5, 6), known=5, size=7)
    grown = mean_start(stored, 8, added)
    mean = stored[:5].mean(dim=0)
    assert torch.equal(grown[:5], stored[:5])
    for row in (5, 6, 7):  # the added ids, in the padding and past it, and a row past both
        torch.testing.assert_close(grown[row], mean)
    assert not torch.allclose(stored.mean(dim=0), mean)  # the padding row would move it


def grown_model(model_dir, *, second_halves: bool = False):
    """The tiny model as training builds it with TOKENS: on meta, grown, filled; or with
    `second_halves`, {name: rows} of what rank 1 of 2 would hold (the second half of each
    parameter's rows), filled as a shard is."""
    added = configured_tokens(model_dir, ModelConfig(path=str(model_dir), **TOKENS))
    model = build_empty_model(model_dir, dtype=torch.float32)
    assert grow_vocabulary(model, added, quiet)
    starts = Starts(seed=0, added=added)
    if not second_halves:
        allocate(model, torch.device("cpu"))
        init_computed_buffers(model)
        fill_weights(model, model_dir, starts, region_of=lambda p: None, local=lambda p: p)
        return model
    params = dict(model.named_parameters())
    held = {n: torch.empty((p.shape[0] + 1) // 2, *p.shape[1:]) for n, p in params.items()}
    by_id = {id(p): held[n] for n, p in params.items()}

    def region_of(p):
        return (slice(p.shape[0] - (p.shape[0] + 1) // 2, p.shape[0]),)

    fill_weights(model, model_dir, starts, region_of=region_of, local=lambda p: by_id[id(p)])
    return held


def test_loading_grows_the_embeddings_whole_or_sharded(tiny_model_dir):
    from keel.models import load_model

    original = load_model(tiny_model_dir, dtype=torch.float32).model.embed_tokens.weight
    model = grown_model(tiny_model_dir)
    embeddings = model.model.embed_tokens.weight
    assert embeddings.shape[0] == VOCAB + 2 and model.config.vocab_size == VOCAB + 2
    assert model.lm_head.weight is embeddings  # still tied
    assert torch.equal(embeddings[:VOCAB], original)
    mean = original.mean(dim=0)
    torch.testing.assert_close(embeddings[VOCAB:], mean.expand(2, -1), rtol=0, atol=1e-7)
    # A rank of 2 holding the second half of the rows reads the same values.
    second = grown_model(tiny_model_dir, second_halves=True)
    assert torch.equal(second["model.embed_tokens.weight"], embeddings[(VOCAB + 2) // 2 :])


def test_lora_and_freeze_train_the_embeddings_and_the_plan_counts_them(tiny_model_dir):
    from keel.config.schema import FreezeConfig, LoraConfig, MethodConfig
    from keel.plan.devices import DeviceSpec
    from keel.plan.planner import plan_run

    lora = MethodConfig(type="lora", lora=LoraConfig(r=4, alpha=8.0, dropout=0.0))
    freeze = MethodConfig(type="freeze", freeze=FreezeConfig(trainable_layers=1))
    added = configured_tokens(tiny_model_dir, ModelConfig(path=str(tiny_model_dir), **TOKENS))
    model = build_empty_model(tiny_model_dir, dtype=torch.float32)
    grow_vocabulary(model, added, quiet)
    assert with_trained_embeddings(model, lora, quiet).lora.modules_to_save == [
        "embed_tokens",
        "lm_head",
    ]
    assert with_trained_embeddings(model, freeze, quiet).freeze.trainable_modules == [
        "embed_tokens",
        "lm_head",
    ]
    with torch.device("meta"):
        adapted = apply_method(model, with_trained_embeddings(model, lora, quiet), log=quiet)
    trainable, _ = count_parameters(adapted)
    embedding = (VOCAB + 2) * model.config.hidden_size
    raw = {
        "model": {"path": str(tiny_model_dir), **TOKENS},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": ["unused.json"]},
        "output": {"dir": "unused"},
    }
    devices = DeviceSpec(kind="cpu", per_node=1, memory_bytes=2**34)
    plan = plan_run(load_config(None, [], base=raw), tiny_model_dir, devices=devices)
    assert plan.censuses["lora"].trainable_params == trainable
    assert plan.shapes.vocab == VOCAB + 2
    without = {**raw, "model": {"path": str(tiny_model_dir)}}
    plain = plan_run(load_config(None, [], base=without), tiny_model_dir, devices=devices)
    assert trainable - plain.censuses["lora"].trainable_params == embedding


def train(model_dir, tmp_path, method: str = "lora"):
    from keel.train.run import run_training

    data = tmp_path / "qa.json"
    rows = [
        {"instruction": f"Question {i}?", "input": "", "output": f"<think>{i}</think><tool>"}
        for i in range(8)
    ]
    data.write_text(json.dumps(rows))
    out = tmp_path / f"run-{method}"
    raw = {
        "model": {"path": str(model_dir), "cache_dir": str(tmp_path / "cache"), **TOKENS},
        "method": {"type": method, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [str(data)], "cutoff_len": 64},
        "train": {"max_steps": 2, "micro_batch_size": 2, "lr": 5e-2, "precision": "fp32"},
        "output": {"dir": str(out), "save_every": 1, "keep_last": 2},
    }
    raw["train"]["threads"] = 1
    if method == "freeze":
        raw["method"]["freeze"] = {"trainable_layers": 1}
    run_training(load_config(None, [], base=raw), log=quiet)
    return out


def export(model, out, adapter=None):
    request = ExportRequest(model=str(model), adapter=adapter and str(adapter), out=out)
    return export_model(request, log=quiet)


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_a_lora_run_trains_the_new_rows_and_every_output_holds_them(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = train(tiny_model_dir, tmp_path)
    saved = AutoTokenizer.from_pretrained(str(run))
    assert len(saved) == VOCAB + 2
    ids = torch.tensor([saved("Q<think>7</think><tool>")["input_ids"]])
    assert {VOCAB, VOCAB + 1} <= set(ids[0].tolist())
    with safe_open(str(run / "adapter_model.safetensors"), framework="pt") as handle:
        trained = handle.get_tensor("base_model.model.model.embed_tokens.weight")
        assert all(".original_module." not in key for key in handle.keys())  # noqa: SIM118
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).model.embed_tokens.weight
    start = base.detach().mean(dim=0)
    assert trained.shape[0] == VOCAB + 2
    assert (trained[VOCAB] - start).abs().max() > 1e-3  # the new rows trained

    unmerged, tokenizer = load_for_inference(str(run), None, cache_dir="unused", log=quiet)
    assert len(tokenizer) == VOCAB + 2
    want = logits(unmerged, ids)
    merged = export(run, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    assert plain.config.vocab_size == VOCAB + 2
    assert (logits(plain, ids) - want).abs().max().item() < 1e-5
    assert len(AutoTokenizer.from_pretrained(str(merged))) == VOCAB + 2
    # The last checkpoint holds the final weights: exported, the same model.
    from_checkpoint = export(run / "checkpoints" / "step-00000002", tmp_path / "from-ckpt")
    first, second = tensors(from_checkpoint), tensors(merged)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert len(AutoTokenizer.from_pretrained(str(from_checkpoint))) == VOCAB + 2
    # A server's adapters share the base as it is: this one is refused, saying why.
    from keel.errors import ModelError
    from keel.infer.serve.adapters import AdapterSet
    from keel.models import load_model

    served = AdapterSet(load_model(tiny_model_dir, dtype=torch.float32), "base")
    with pytest.raises(ModelError, match="trained with tokens added to the vocabulary"):
        served.load("tokens", str(run))


def test_a_freeze_run_trains_the_new_rows(tiny_model_dir, tmp_path):
    run = train(tiny_model_dir, tmp_path, "freeze")
    weights = tensors(run)["model.embed_tokens.weight"]
    base = tensors(tiny_model_dir)["model.embed_tokens.weight"]
    assert weights.shape[0] == VOCAB + 2
    assert (weights[VOCAB] - base.mean(dim=0)).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"add_tokens": [" "]}, "model.add_tokens[0] = ' ': a token needs"),
        (
            {"add_tokens": ["<a>"], "add_special_tokens": ["<a>"]},
            "model.add_special_tokens[0] = '<a>' is also model.add_tokens[0]",
        ),
    ],
)
def test_blank_and_twice_named_tokens_are_refused(tmp_path, model, message):
    raw = {
        "model": {"path": str(tmp_path), **model},
        "data": {"datasets": ["d.json"]},
        "output": {"dir": str(tmp_path / "out")},
    }
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [], base=raw)


def test_a_vision_language_model_is_refused(tmp_path):
    from vlm_support import write_tiny_llava_dir

    from keel.train.preflight import check_model

    folder = write_tiny_llava_dir(tmp_path / "llava")
    raw = {
        "model": {"path": str(folder), "add_tokens": ["<think>"]},
        "method": {"type": "lora"},
        "data": {"datasets": ["d.json"]},
        "output": {"dir": str(tmp_path / "out")},
    }
    _, problems = check_model(load_config(None, [], base=raw), folder, attn="sdpa", precision=None)
    assert problems == [
        "model.add_tokens: LlavaForConditionalGeneration is a vision-language model, whose "
        "processor keeps its own tokenizer; keel adds tokens to text models only"
    ]
