"""Images through keel's data pipeline: formats, encoding, masking, cutting, packing, cache.

Tiny Qwen2-VL (M-RoPE) and LLaVA folders built with tests/vlm_support.py (config, tokenizer
and image processor: data preparation reads no weights); the references are transformers'
own processors (the PIL image processors: no torchvision here).
"""

from __future__ import annotations

import base64
import json
import os

import pytest
import torch
from vlm_support import (
    QWEN2_VL_SPECIALS,
    build_llava_image_processor,
    build_llava_tokenizer,
    build_qwen2_vl_image_processor,
    build_qwen2_vl_tokenizer,
    llava_config,
    qwen2_vl_config,
    write_image,
    write_images,
)

from keel.config.schema import DataConfig, DatasetConfig
from keel.data.batching import collate
from keel.data.formats import make_spec, row_to_example
from keel.data.pipeline import prepare_data
from keel.errors import DataError
from keel.models.vision import vision_processing
from keel.models.vision.blobs import unpack

QUESTION, ANSWER = "What is in the picture?", "Noise."


def _model_folder(folder, tokenizer, config, image_processor):
    """(folder, tokenizer, VisionProcessing) of a model folder without weights."""
    from transformers import AutoTokenizer

    for part in (config, tokenizer, image_processor):
        part.save_pretrained(folder)
    return folder, AutoTokenizer.from_pretrained(folder), vision_processing(folder, None, print)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(model folder, tokenizer, VisionProcessing) of a tiny Qwen2-VL."""
    tok = build_qwen2_vl_tokenizer()
    folder = tmp_path_factory.mktemp("qwen2_vl")
    return _model_folder(folder, tok, qwen2_vl_config(tok), build_qwen2_vl_image_processor())


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    tok = build_llava_tokenizer()
    folder = tmp_path_factory.mktemp("llava")
    return _model_folder(folder, tok, llava_config(tok), build_llava_image_processor())


def prepare(tmp_path, model, datasets, *, stage="sft", logs=None, **data):
    _, tokenizer, vision = model
    configs = [d if isinstance(d, DatasetConfig) else DatasetConfig(path=str(d)) for d in datasets]
    return prepare_data(
        DataConfig(datasets=configs, **data),
        tokenizer,
        stage=stage,
        cache_dir=tmp_path / "cache",
        base_dir=tmp_path,
        seed=0,
        log=(logs if logs is not None else []).append,
        vision=vision,
    )


def write_json(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return path


def chat(user_content, answer=ANSWER):
    return [
        {"role": "user", "content": user_content},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def plain(user, answer=ANSWER):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


# --- the three input formats -----------------------------------------------------------------


def test_every_format_gives_the_same_tokens_and_images(tmp_path, qwen):
    image = write_image(tmp_path / "lf" / "imgs" / "cat.png", seed=3)
    # LLaMA-Factory: sharegpt entry with an images column, the path relative to dataset_dir
    write_json(
        tmp_path / "lf" / "mllm.json",
        [
            {
                "messages": [
                    {"role": "user", "content": f"<image>{QUESTION}"},
                    {"role": "assistant", "content": ANSWER},
                ],
                "images": ["imgs/cat.png"],
            }
        ],
    )
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user"}
    info = {
        "mllm": {
            "file_name": "mllm.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {**tags, "assistant_tag": "assistant"},
        }
    }
    write_json(tmp_path / "lf" / "dataset_info.json", info)
    lf = prepare(tmp_path / "a", qwen, ["mllm"], dataset_dir=str(tmp_path / "lf"))

    data_url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    rows = {
        "trl": {
            "messages": chat([{"type": "image"}, {"type": "text", "text": QUESTION}]),
            "images": [str(image)],
        },
        **{
            name: {
                "messages": chat(
                    [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": QUESTION},
                    ]
                )
            }
            for name, url in [
                ("path", str(image)),
                ("file_url", image.as_uri()),
                ("data_url", data_url),
            ]
        },
    }
    expected = lf.train[0]
    assert expected["image_blobs"] and len(expected["image_blobs"]) == 1
    for name, row in rows.items():
        got = prepare(tmp_path / name, qwen, [write_json(tmp_path / f"{name}.json", [row])])
        assert got.train[0]["input_ids"] == expected["input_ids"], name
        assert got.train[0]["targets"] == expected["targets"], name
        assert got.train[0]["rope_positions"] == expected["rope_positions"], name
        assert got.train[0]["image_blobs"] == expected["image_blobs"], name


def test_image_parts_become_placeholders_in_order():
    spec = make_spec("messages", {}, {})
    row = {
        "messages": chat(
            [
                {"type": "image_url", "image_url": {"url": "a.png"}},
                {"type": "text", "text": "and"},
                {"type": "image"},
            ]
        ),
        "images": ["b.png"],
    }
    example = row_to_example(row, spec)
    assert example.content[0]["content"] == "<image>and<image>"
    assert example.images == ("a.png", "b.png")
    text_row = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    assert row_to_example(text_row, spec).images == ()


# --- encoded rows == transformers' processors ----------------------------------------------


def _one_image_rows(tmp_path, model, image):
    row = {"messages": chat(f"<image>{QUESTION}"), "images": [str(image)]}
    return prepare(tmp_path, model, [write_json(tmp_path / "d.json", [row])])


def test_qwen2_vl_row_matches_the_processor(tmp_path, qwen):
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(Qwen2VLProcessor):  # Qwen2VLProcessor needs torchvision's video one
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    _, tokenizer, vision = qwen
    image = write_image(tmp_path / "x.png", seed=1, size=(100, 80))
    row = _one_image_rows(tmp_path, qwen, image).train[0]
    text = tokenizer.apply_chat_template(plain(f"<image>{QUESTION}"), tokenize=False)
    text = text.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    processor = ImageOnlyProcessor(image_processor=vision.image_processor, tokenizer=tokenizer)
    from PIL import Image

    enc = processor(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    assert row["input_ids"] == enc["input_ids"][0].tolist()
    (blob,) = [unpack(b) for b in row["image_blobs"]]
    assert torch.equal(blob["pixel_values"], enc["pixel_values"])
    assert torch.equal(blob["image_grid_thw"], enc["image_grid_thw"])
    # the family's [3, T] positions (== get_rope_index: test_vision_families), t/h/w per token
    positions = vision.family.rope_positions(row["input_ids"], [blob], vision.model_config)
    assert row["rope_positions"] == positions.t().reshape(-1).tolist()
    assert row["rope_positions"][-3:] != [len(row["input_ids"]) - 1] * 3  # the image moved them


def test_llava_row_matches_the_processor(tmp_path, llava):
    from PIL import Image
    from transformers import LlavaProcessor

    _, tokenizer, vision = llava
    image = write_image(tmp_path / "x.png", seed=2)
    row = _one_image_rows(tmp_path, llava, image).train[0]
    text = tokenizer.apply_chat_template(plain(f"<image>{QUESTION}"), tokenize=False)
    processor = LlavaProcessor(
        image_processor=vision.image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    enc = processor(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    assert row["input_ids"] == enc["input_ids"][0].tolist()
    (blob,) = [unpack(b) for b in row["image_blobs"]]
    assert torch.equal(blob["pixel_values"], enc["pixel_values"])
    assert "rope_positions" not in row  # 1-D positions


# --- masks, counts, cutting ------------------------------------------------------------------


def _image_ids(tokenizer):
    return {tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIALS}


def test_image_tokens_are_never_targets(tmp_path, qwen):
    _, tokenizer, _ = qwen
    images = write_images(tmp_path / "imgs", 2)
    rows = [{"text": "<image> a picture and <image> another", "images": [str(p) for p in images]}]
    pt = prepare(tmp_path / "pt", qwen, [write_json(tmp_path / "pt.json", rows)], stage="pt")
    sft_rows = [
        {
            "messages": [
                {"role": "user", "content": "<image> look"},
                {"role": "assistant", "content": "it is <image> this"},
            ],
            "images": [str(p) for p in images],
        }
    ]
    sft = prepare(tmp_path / "sft", qwen, [write_json(tmp_path / "sft.json", sft_rows)])
    whole = prepare(
        tmp_path / "whole",
        qwen,
        [write_json(tmp_path / "sft.json", sft_rows)],
        train_on_prompt=True,
    )
    for data in (pt, sft, whole):
        row = data.train[0]
        assert len(row["image_blobs"]) == 2
        image_ids = _image_ids(tokenizer)
        assert sum(t in image_ids for t in row["input_ids"]) > 8
        assert not image_ids & set(row["targets"])
        assert any(t != -100 for t in row["targets"])
    # data.train_on_prompt: the user's words train too, the images still do not
    trained = [
        tokenizer.decode([t for t in d.train[0]["targets"] if t != -100]) for d in (sft, whole)
    ]
    assert "look" not in trained[0] and "look" in trained[1]


def test_placeholder_and_image_counts_must_match(tmp_path, qwen):
    image = write_image(tmp_path / "x.png")
    good = {"messages": chat(f"<image>{QUESTION}"), "images": [str(image)]}
    bad = {"messages": chat(f"<image><image>{QUESTION}"), "images": [str(image)]}
    unfilled = {"messages": chat(f"<image>{QUESTION}")}  # a vision model reads it as an image
    path = write_json(tmp_path / "d.json", [good, bad, unfilled])
    with pytest.raises(DataError, match=r"row 2: 2 image placeholder.*but 1 image") as err:
        prepare(tmp_path, qwen, [path])
    assert err.value.exit_code == 2
    skipped = prepare(tmp_path, qwen, [path], on_invalid="skip")
    assert skipped.report.num_rejected == 2 and len(skipped.train) == 1
    assert "row 3: 1 image placeholder(s)" in skipped.report.format()


def test_bad_image_and_text_model_rows_are_rejected(tmp_path, qwen, tiny_tokenizer):
    missing = {"messages": chat(f"<image>{QUESTION}"), "images": ["nope.png"]}
    path = write_json(tmp_path / "d.json", [missing])
    with pytest.raises(DataError, match="nope.png"):
        prepare(tmp_path, qwen, [path])
    image = write_image(tmp_path / "x.png")
    path = write_json(
        tmp_path / "t.json", [{"messages": chat("<image>hi"), "images": [str(image)]}]
    )
    with pytest.raises(DataError, match="text model"):
        prepare(tmp_path / "t", (None, tiny_tokenizer, None), [path])


def test_a_cut_inside_an_image_drops_the_row_and_says_why(tmp_path, qwen):
    image = str(write_image(tmp_path / "x.png", size=(112, 112)))  # 16 image tokens
    rows = [
        {"text": "<image> a picture", "images": [image]},  # cut inside the image
        {"text": "many words " * 12 + "<image>", "images": [image]},  # cut before it
        {"text": "short", "images": []},
    ]
    path = write_json(tmp_path / "d.json", rows)
    cut = prepare(tmp_path, qwen, [path], stage="pt", cutoff_len=10, overlength="truncate")
    assert cut.report.totals().dropped == 1 and cut.report.totals().truncated == 1
    (drop,) = cut.report.drops
    assert drop.row == 1 and "cutoff_len 10 falls inside image 1" in drop.reason
    assert "dropped rows" in cut.report.format()
    assert len(cut.train) == 2
    for row in cut.train:
        assert len(row["input_ids"]) <= 10 and not row["image_blobs"]
        assert len(row["rope_positions"]) == 3 * len(row["input_ids"])


def test_pretraining_rows_with_images_are_never_cut_into_pieces(tmp_path, qwen):
    image = str(write_image(tmp_path / "x.png", size=(112, 112)))  # 16 image tokens
    rows = [{"text": "<image> a picture", "images": [image]}, {"text": "short", "images": []}]
    path = write_json(tmp_path / "d.json", rows)
    auto = prepare(tmp_path / "auto", qwen, [path], stage="pt", cutoff_len=10)
    assert auto.report.overlength == "drop" and auto.report.totals().dropped == 1
    with pytest.raises(DataError, match="overlength = split cuts pretraining text"):
        prepare(tmp_path / "split", qwen, [path], stage="pt", cutoff_len=10, overlength="split")


# --- preference pairs --------------------------------------------------------------------------


def test_pairs_hold_the_prompt_images_in_both_sequences(tmp_path, qwen):
    image = write_image(tmp_path / "x.png")
    row = {
        "prompt": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}
        ],
        "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
        "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
        "images": [str(image)],
    }
    data = prepare(tmp_path, qwen, [write_json(tmp_path / "p.json", [row])], stage="dpo")
    got = data.train[0]
    assert len(got["image_blobs"]) == 2 and got["image_blobs"][0] == got["image_blobs"][1]
    assert len(got["rope_positions"]) == 3 * len(got["input_ids"])


def _kto_rows(folder) -> list[dict]:
    """Three KTO samples: one image, none, two (in messages); answers of unequal lengths."""
    small = write_image(folder / "s.png", seed=1, size=(56, 56))
    big = write_image(folder / "b.png", seed=2, size=(112, 84))
    return [
        {"prompt": "<image> colour?", "completion": "red", "label": True, "images": [str(small)]},
        {"prompt": "plain question", "completion": "a much longer answer", "label": False},
        {
            "prompt": [{"role": "user", "content": "<image> and <image>?"}],
            "completion": [{"role": "assistant", "content": "both"}],
            "label": True,
            "images": [str(big), str(small)],
        },
    ]


def test_kto_mismatched_sequences_hold_their_prompts_images_and_positions(tmp_path, qwen):
    """A KTO sample's KL sequence is its own prompt (its images) with the next sample's
    answer: its 3-D rotary positions must be what the family computes for those tokens and
    images, whatever the answers' lengths (the next answer here is longer or shorter)."""
    _, _, vision = qwen
    rows = _kto_rows(tmp_path)
    small = rows[0]["images"][0]
    data = prepare(tmp_path, qwen, [write_json(tmp_path / "k.json", rows)], stage="kto")
    rows = sorted(data.train, key=lambda row: len(row["image_blobs"]))
    assert [len(row["image_blobs"]) for row in rows] == [0, 1, 2]
    for row in rows:
        images = [unpack(blob) for blob in row["image_blobs"]]  # the sample's
        for prefix in ("", "kl_"):
            ids = row[f"{prefix}input_ids"]
            want = vision.family.rope_positions(ids, images, vision.model_config)  # [3, T]
            got = torch.tensor(row[f"{prefix}rope_positions"]).view(-1, 3).t()
            assert torch.equal(got, want), prefix
        assert row["kl_input_ids"] != row["input_ids"]  # another sample's answer
    bad = [{"prompt": "colour?", "completion": "<image> red", "label": True, "images": [small]}]
    with pytest.raises(DataError, match="the answer holds an image"):
        prepare(tmp_path / "bad", qwen, [write_json(tmp_path / "bad.json", bad * 2)], stage="kto")


# --- packing, collate, cache -----------------------------------------------------------------


def _mixed_rows(tmp_path):
    small = write_image(tmp_path / "s.png", seed=1, size=(56, 56))
    big = write_image(tmp_path / "b.png", seed=2, size=(112, 84))
    return [
        {"messages": chat("<image> first", "one"), "images": [str(small)]},
        {"messages": chat("no image here", "two")},
        {"messages": chat("<image> and <image>", "three"), "images": [str(big), str(small)]},
        {"messages": chat("<image> last", "four"), "images": [str(big)]},
    ]


def test_packed_rows_collate_as_their_samples(tmp_path, qwen):
    path = write_json(tmp_path / "d.json", _mixed_rows(tmp_path))
    unpacked = prepare(tmp_path / "u", qwen, [path], cutoff_len=256).train
    packed = prepare(tmp_path / "p", qwen, [path], cutoff_len=256, packing=True).train
    assert len(packed) < len(unpacked)
    by_ids = {tuple(row["input_ids"]): row for row in unpacked}
    for row in packed:
        bounds = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        samples = [by_ids[tuple(row["input_ids"][a:b])] for a, b in zip(bounds, bounds[1:])]
        got = collate([row], pad_id=0)
        want = collate(samples, pad_id=0, padding_free=True)
        for key in ("input_ids", "targets", "position_ids", "rope_position_ids"):
            assert torch.equal(got[key], want[key]), key
        assert len(got.get("images", [])) == len(want.get("images", []))
        for a, b in zip(got.get("images", []), want.get("images", [])):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_collate_pads_rope_positions_like_position_ids(tmp_path, qwen):
    path = write_json(tmp_path / "d.json", _mixed_rows(tmp_path))
    rows = list(prepare(tmp_path, qwen, [path]).train)
    batch = collate(rows, pad_id=0)
    assert batch["rope_position_ids"].shape == (3, *batch["input_ids"].shape)
    assert len(batch["images"]) == sum(len(r["image_blobs"]) for r in rows) == 4
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        for axis in range(3):
            assert torch.equal(
                batch["rope_position_ids"][axis, b, n:], batch["position_ids"][b, n:]
            )
    text_only = rows[1]
    assert (
        batch["rope_position_ids"][:, 1, : len(text_only["input_ids"])]
        .eq(batch["position_ids"][1, : len(text_only["input_ids"])])
        .all()
    )


def test_cache_reproduces_rows_and_a_changed_image_invalidates_it(tmp_path, qwen):
    rows = _mixed_rows(tmp_path)
    path = write_json(tmp_path / "d.json", rows)
    first = prepare(tmp_path, qwen, [path])
    again = prepare(tmp_path, qwen, [path])
    assert again.from_cache and again.fingerprint == first.fingerprint
    assert again.train.to_dict() == first.train.to_dict()
    small = tmp_path / "s.png"
    write_image(small, seed=9, size=(84, 56))  # a new picture, another size
    stamp = small.stat().st_mtime_ns + 10**9
    os.utime(small, ns=(stamp, stamp))
    logs = []
    changed = prepare(tmp_path, qwen, [path], logs=logs)
    assert not changed.from_cache and any("stale" in line for line in logs)
    assert changed.train["image_blobs"] != first.train["image_blobs"]
    assert prepare(tmp_path, qwen, [path]).from_cache


def test_text_model_fingerprint_and_columns_are_unchanged(tmp_path, tiny_tokenizer, qwen):
    rows = [{"messages": chat("hello", "world")}]
    path = write_json(tmp_path / "d.json", rows)
    text = prepare(tmp_path / "t", (None, tiny_tokenizer, None), [path])
    assert set(text.train.column_names) == {"input_ids", "targets", "position_ids", "num_targets"}
    vision = prepare(tmp_path / "v", qwen, [path])
    assert "rope_positions" in vision.train.column_names
    assert vision.fingerprint != prepare(tmp_path / "q", (None, qwen[1], None), [path]).fingerprint


def test_kto_kl_statistic_scores_the_mismatched_sequences_with_their_images(tmp_path, qwen):
    """KTO's KL estimate (the policy's log-ratio to the reference on the mismatched
    sequences) with images: what transformers computes for each KL sequence alone, from its
    ids and its prompt's images (positions by transformers' own M-RoPE), padded rows and
    rows laid end to end alike."""
    import copy

    from peft import LoraConfig, get_peft_model
    from vlm_support import build_tiny_qwen2_vl

    from keel.data import collate
    from keel.stages.registry import get_stage
    from keel.train.preference import PreferenceObjective

    _, tokenizer, vision = qwen
    data = prepare(
        tmp_path, qwen, [write_json(tmp_path / "k.json", _kto_rows(tmp_path))], stage="kto"
    )
    rows = list(data.train)
    torch.manual_seed(0)
    base = build_tiny_qwen2_vl(tokenizer).eval()
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    policy = get_peft_model(copy.deepcopy(base), lora).eval()  # random B: not the base
    stage = get_stage("kto")
    objective = PreferenceObjective(
        policy, stage=stage, settings=stage.settings(), vision=vision.family
    )

    def alone(model, row) -> float:
        ids = torch.tensor([row["kl_input_ids"]])
        inputs = vision.family.model_inputs([unpack(blob) for blob in row["image_blobs"]])
        inputs |= vision.family.token_inputs(ids, vision.model_config)
        with torch.no_grad():
            logps = model(input_ids=ids, **inputs).logits[0].float().log_softmax(-1)
        return sum(logps[i, t].item() for i, t in enumerate(row["kl_targets"]) if t != -100)

    want = sum(alone(policy, row) - alone(base, row) for row in rows)
    assert abs(want) > 1e-3  # the policy differs from its reference on these sequences
    for padding_free in (False, True):
        total, count = objective(collate(rows, 0, padding_free=padding_free), mode="statistic")
        assert count.item() == 3
        # the log-probs are ~100 in size, summed in other orders: 1e-6 of them
        assert total.item() == pytest.approx(want, abs=1e-4), padding_free
