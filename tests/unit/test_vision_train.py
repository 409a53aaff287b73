"""`keel train` on tiny vision-language models (Qwen2-VL: M-RoPE; LLaVA-1.5: 1-D positions).

Real runs through keel.cli.main on a folder from tests/vlm_support.py and a small dataset of
coloured images mixed with text-only rows: they train (finite, falling loss), a frozen tower
leaves the run bit for bit as it came, and samples laid end to end (padding-free) or packed
give the losses right-padded rows give (fp32).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from cli_support import keel_in_process
from safetensors.torch import load_file
from vlm_support import (
    write_colour_dataset,
    write_image,
    write_tiny_llava_dir,
    write_tiny_qwen2_vl_dir,
)

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}  # dpo pairs
REL = 1e-5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_train")
    return {
        "root": root,
        "data": str(write_colour_dataset(root)),
        "qwen2_vl": write_tiny_qwen2_vl_dir(root / "qwen2_vl"),
        "llava": write_tiny_llava_dir(root / "llava"),
    }


def train(workspace, model: str, out: str, *overrides: str):
    """Run `keel train`; returns (output folder, {step: loss}); the run's log in
    `workspace["log"]`."""
    root = workspace["root"]
    config = {
        "model": {"path": str(workspace[model]), "cache_dir": str(root / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [workspace["data"]], "cutoff_len": 128},
        "train": {
            "max_steps": 4,
            "micro_batch_size": 2,
            "global_batch_size": 6,
            "lr": 5e-3,
            "scheduler": "constant",
            "precision": "fp32",
            "threads": 1,
        },
        "output": {"dir": str(root / out)},
    }
    path = root / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = keel_in_process("--verbose", "train", str(path), *overrides, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    workspace["log"] = done.stdout + done.stderr
    records = [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]
    return root / out, {r["step"]: r["loss"] for r in records if "loss" in r}


def _assert_learns(losses: dict[int, float]) -> None:
    values = list(losses.values())
    assert len(values) == 4 and all(math.isfinite(v) for v in values)
    assert max(values[1:]) < values[0], values


def _assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= REL * abs(want[step]), (step, got, want)


def _tower(weights: dict, prefixes: tuple[str, ...]) -> dict:
    return {k: v for k, v in weights.items() if k.startswith(prefixes)}


@pytest.mark.parametrize(
    "model,tower",
    # names as saved (the checkpoint layout): tower and projector, both frozen by default
    [("qwen2_vl", ("visual.",)), ("llava", ("vision_tower.", "multi_modal_projector."))],
)
def test_full_training_learns_and_leaves_a_frozen_tower_as_it_was(workspace, model, tower):
    out, losses = train(workspace, model, f"{model}-full", "method.type=full")
    _assert_learns(losses)
    before = load_file(workspace[model] / "model.safetensors")
    after = load_file(out / "model.safetensors")
    frozen = _tower(before, tower)
    assert frozen and all(torch.equal(after[k], v) for k, v in frozen.items())
    assert any(not torch.equal(after[k], v) for k, v in before.items() if k not in frozen)


@pytest.mark.parametrize("model", ["qwen2_vl", "llava"])
def test_padding_free_and_packed_match_padded_rows(workspace, model):
    """LoRA (the language model only): one row per sample right-padded, samples laid end to
    end (keel's varlen attention), and packed rows: the same losses."""
    _, padded = train(workspace, model, f"{model}-padded", "train.padding_free=false")
    _assert_learns(padded)
    out, free = train(workspace, model, f"{model}-free", "train.padding_free=true")
    assert "micro-batches: padding-free" in workspace["log"]
    _assert_same(free, padded)
    _, packed = train(workspace, model, f"{model}-packed", "data.packing=true")
    assert "6 samples in 4 rows" in workspace["log"]  # one global batch: every sample
    _assert_same(packed, padded)
    if model == "qwen2_vl":  # packed rows right-padded: transformers splits the samples
        # by the text row of the [4, B, T] positions
        extra = ("data.packing=true", "train.padding_free=false")
        _, packed_padded = train(workspace, model, f"{model}-packed-padded", *extra)
        _assert_same(packed_padded, padded)


def _pairs(folder) -> str:
    rows = []
    for index, (name, rgb) in enumerate(COLOURS.items()):
        image = write_image(folder / f"pair{index}.png", seed=index, colour=rgb)
        wrong = "blue" if name != "blue" else "red"
        rows.append(
            {
                "prompt": [{"role": "user", "content": "<image>What colour is this?"}],
                "chosen": [{"role": "assistant", "content": f"It is {name}."}],
                "rejected": [{"role": "assistant", "content": f"It is {wrong}."}],
                "images": [str(image)],
            }
        )
    path = folder / "pairs.json"
    path.write_text(json.dumps(rows))
    return str(path)


def test_dpo_with_images_trains(workspace):
    """Pairs whose prompt holds an image: the policy and the reference (LoRA off) score
    both sequences with it."""
    pairs = _pairs(workspace["root"])
    extra = ("train.stage=dpo", f"data.datasets=[{pairs}]", "train.global_batch_size=3")
    _, losses = train(workspace, "qwen2_vl", "qwen2_vl-dpo", *extra)
    values = list(losses.values())
    assert len(values) == 4 and all(math.isfinite(v) for v in values)
    assert abs(values[0] - math.log(2)) < 1e-4  # policy == reference at the start
    assert values[-1] < values[0], values


def _kto_samples(folder) -> str:
    """A desirable and an undesirable answer per colour, one image in each prompt but the
    last colour's, which shows two (the KL sequences pair prompts with other answers)."""
    rows = []
    for index, (name, rgb) in enumerate(COLOURS.items()):
        images = [str(write_image(folder / f"kto{index}.png", seed=index, colour=rgb))]
        if index == 2:
            images.append(str(write_image(folder / "kto-extra.png", seed=9, size=(56, 56))))
        prompt = "<image>" * len(images) + "What colour is this?"
        wrong = "blue" if name != "blue" else "red"
        for answer, label in ((f"It is {name}.", True), (f"It is {wrong}, surely.", False)):
            rows.append({"prompt": prompt, "completion": answer, "label": label, "images": images})
    path = folder / "kto.json"
    path.write_text(json.dumps(rows))
    return str(path)


def test_kto_with_images_trains_alike_padded_padding_free_and_packed(workspace):
    """KTO samples whose prompts hold images: each sample and its KL sequence (its prompt,
    another sample's answer) are scored with the prompt's images, by the policy and the
    reference (LoRA off); the same losses whether rows are padded, laid end to end or
    packed."""
    samples = _kto_samples(workspace["root"])
    extra = ("train.stage=kto", f"data.datasets=[{samples}]")
    _, padded = train(workspace, "qwen2_vl", "kto-padded", *extra, "train.padding_free=false")
    values = list(padded.values())
    assert len(values) == 4 and all(math.isfinite(v) for v in values)
    assert abs(values[0] - 0.5) < 1e-6  # policy == reference, KL 0: every sample's loss 1/2
    assert values[-1] < values[0], values
    _, free = train(workspace, "qwen2_vl", "kto-free", *extra, "train.padding_free=true")
    _assert_same(free, padded)
    _, packed = train(workspace, "qwen2_vl", "kto-packed", *extra, "data.packing=true")
    _assert_same(packed, padded)


def test_resumed_run_matches_an_uninterrupted_one(workspace):
    """Stopped after 2 of 4 steps and resumed (images come back from the data cache): the
    same losses and adapter weights as one run of 4 steps."""
    want_dir, want = train(workspace, "qwen2_vl", "qwen2_vl-whole", "output.save_every=2")
    train(workspace, "qwen2_vl", "qwen2_vl-resumed", "output.save_every=2", "train.max_steps=2")
    got_dir, got = train(workspace, "qwen2_vl", "qwen2_vl-resumed", "output.save_every=2")
    assert "resum" in workspace["log"].lower()
    _assert_same(got, want)
    name = "adapter_model.safetensors"
    got_weights, want_weights = load_file(got_dir / name), load_file(want_dir / name)
    assert got_weights.keys() == want_weights.keys()
    for key, value in want_weights.items():
        torch.testing.assert_close(got_weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_fast_head_merges_the_images():
    """The fast loss head (hidden states -> chunked output layer) on a micro-batch with an
    image: the same loss as the model's own forward, because its hidden states come from
    the base vision-language model, which puts the image features in (the text decoder
    alone never sees them)."""
    from vlm_support import (
        build_qwen2_vl_image_processor,
        build_qwen2_vl_tokenizer,
        build_tiny_qwen2_vl,
        make_image,
    )

    from keel.models.vision import family_of
    from keel.train.objective import CausalLMObjective

    tokenizer = build_qwen2_vl_tokenizer()
    model = build_tiny_qwen2_vl(tokenizer)
    family = family_of(model.config)
    (image,) = family.prepare_images(
        build_qwen2_vl_image_processor(), [make_image(0)], model.config
    )
    prompt = tokenizer("user: colour? " + image.text, add_special_tokens=False)["input_ids"]
    answer = tokenizer(" red<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = prompt + answer
    targets = [-100] * (len(prompt) - 1) + answer + [-100]  # pre-shifted
    rope = family.rope_positions(ids, [image.tensors], model.config)  # [3, T]
    batch = {
        "input_ids": torch.tensor([ids]),
        "targets": torch.tensor([targets]),
        "position_ids": None,
        "images": [image.tensors],
        "rope_position_ids": rope[:, None],  # [3, 1, T]
    }
    full = CausalLMObjective(model, vision=family)
    fast = CausalLMObjective(model, chunk_size=3, vision=family)
    ok, why = fast.check_fast_head()
    assert ok, why
    fast.fast_head = True
    want, got = full(batch).loss, fast(batch).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # What a text decoder alone computes: the image tokens' own embeddings instead of the
    # image features (a different loss, so the agreement above is not vacuous).
    text_only = fast({**batch, "images": None}).loss
    assert (text_only - want).abs() > 1e-3


@pytest.mark.parametrize("method", ["full", "lora"])
def test_llava_next_trains_its_projector_and_newline_embedding(workspace, method):
    """LLaVA-NeXT's projector includes a bare parameter (image_newline) beside its module:
    full training with model.vision.freeze_projector false trains both (and the memory plan
    counts it with the projector); LoRA trains the projector module and leaves the bare
    parameter as the base has it (PEFT saves modules only)."""
    from vlm_support import write_tiny_llava_next_dir

    if "llava_next" not in workspace:
        workspace["llava_next"] = write_tiny_llava_next_dir(workspace["root"] / "llava_next")
    out, losses = train(
        workspace,
        "llava_next",
        f"next-{method}",
        f"method.type={method}",
        "model.vision.freeze_projector=false",
    )
    _assert_learns(losses)
    assert "projector" in workspace["log"]
    if method == "full":
        before = load_file(workspace["llava_next"] / "model.safetensors")
        after = load_file(out / "model.safetensors")
        newline = [k for k in after if k.endswith("image_newline")]
        assert newline and not torch.equal(after[newline[0]], before[newline[0]])
