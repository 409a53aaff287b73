"""grpo with a vision-language model: prompts with images, as data rows, as generation
prompts and as trained rollout rows, each checked against what transformers computes for
the same tokens and images on its own."""

from __future__ import annotations

import json

import pytest
import torch
from vlm_support import make_image, write_image, write_tiny_qwen2_vl_dir

from keel.config.schema import DataConfig, DatasetConfig
from keel.data import collate
from keel.data.pipeline import prepare_data
from keel.errors import ImageError
from keel.models.vision import vision_processing
from keel.models.vision.blobs import unpack


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(model, tokenizer, VisionProcessing, prompt rows) of a tiny Qwen2-VL and three grpo
    prompts: one image, two images (in messages), none."""
    from transformers import AutoTokenizer

    from keel.models.loading import load_model

    root = tmp_path_factory.mktemp("grpo_vision")
    folder = write_tiny_qwen2_vl_dir(root / "model")
    small = write_image(root / "s.png", seed=1, size=(56, 56))
    big = write_image(root / "b.png", seed=2, size=(112, 84))
    rows = [
        {"prompt": [{"role": "user", "content": "<image>Colour?"}], "images": [str(small)],
         "answer": "red"},
        {"prompt": [{"role": "user", "content": "<image> then <image>: which is larger?"}],
         "images": [str(big), str(small)], "answer": "first"},
        {"prompt": [{"role": "user", "content": "No picture here."}], "answer": "none"},
    ]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vision = vision_processing(folder, None, lambda _m: None)
    data = _prompt_rows(root, rows, tokenizer, vision)
    model = load_model(folder, dtype=torch.float32).eval()
    prompts = sorted(data, key=lambda row: -len(row.get("image_blobs") or []))
    return model, tokenizer, vision, prompts


def _prompt_rows(root, rows: list[dict], tokenizer, vision, **dataset) -> list[dict]:
    """grpo's prompt rows of `rows` (root/prompts.json, images read relative to root)."""
    (root / "prompts.json").write_text(json.dumps(rows))
    data = prepare_data(
        DataConfig(
            datasets=[DatasetConfig(path=str(root / "prompts.json"), **dataset)], cutoff_len=512
        ),
        tokenizer,
        stage="grpo",
        cache_dir=root / "cache",
        base_dir=root,
        seed=0,
        log=lambda _m: None,
        vision=vision,
    )
    return list(data.train)


def _images(row) -> list[dict]:
    return [unpack(blob) for blob in row.get("image_blobs") or []]


def test_prompt_rows_hold_their_images_and_positions(qwen):
    _, tokenizer, vision, prompts = qwen
    image_id = tokenizer.convert_tokens_to_ids(vision.family.image_token)
    assert [len(row.get("image_blobs") or []) for row in prompts] == [2, 1, 0]
    for row in prompts:
        images = _images(row)
        features = sum(int(image["image_grid_thw"].prod()) // 4 for image in images)
        assert row["input_ids"].count(image_id) == features
        want = vision.family.rope_positions(row["input_ids"], images, vision.model_config)
        got = torch.tensor(row["rope_positions"]).view(-1, 3).t()
        assert torch.equal(got, want)
        assert "images" not in json.loads(row["columns"])  # read, not a reward's column
        assert json.loads(row["columns"])["answer"]


def test_rollout_rows_continue_the_prompts_positions(qwen):
    """prompt + completion: the completion's 3-D positions go on from the prompt's largest,
    as the family computes them for the whole sequence."""
    from keel.train.rollout_rows import rollout_row

    _, _, vision, prompts = qwen
    for row in prompts:
        rollout = rollout_row(row, [11, 12, 13, 14], 0.5, trained=True)
        want = vision.family.rope_positions(rollout["input_ids"], _images(row), vision.model_config)
        assert torch.equal(torch.tensor(rollout["rope_positions"]).view(-1, 3).t(), want)
        assert "prompt_len" not in rollout  # each sequence whole: the images are its own


def test_generation_with_images_is_transformers_greedy_decoding(qwen):
    from keel.infer.batch_generate import GroupRequest, Sampling, generate_groups
    from keel.infer.vision import stored_image_prompt

    model, tokenizer, _, prompts = qwen
    requests = [
        GroupRequest(
            prompt_ids=list(row["input_ids"]),
            n=2,
            seed=7,
            images=stored_image_prompt(row, model.config) if row.get("image_blobs") else None,
        )
        for row in prompts
    ]
    groups = generate_groups(
        model, tokenizer, requests, Sampling(max_tokens=6, temperature=0.0), max_batch_size=6
    )
    for row, group in zip(prompts, groups):
        ids = torch.tensor([row["input_ids"]])
        inputs = (
            dict(stored_image_prompt(row, model.config).inputs) if row.get("image_blobs") else {}
        )
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, **inputs, max_new_tokens=6, do_sample=False, pad_token_id=0
            )
        want = out[0, ids.shape[1] :].tolist()
        for completion in group:  # greedy: both samples alike
            got = completion.token_ids
            assert got == want[: len(got)], (got, want)


@pytest.mark.parametrize("padding_free", [False, True])
def test_rollout_log_probs_are_each_sequences_own(qwen, padding_free):
    """The objective's per-token log-probs of a micro-batch of rollout rows (a prompt with
    two images, one with one, one without) equal transformers' forward of each alone, with
    its images and transformers' own 3-D positions."""
    from keel.stages.grpo import GrpoSettings
    from keel.train.grpo_objective import PolicyGradientObjective
    from keel.train.rollout_rows import rollout_row

    model, _, vision, prompts = qwen
    rows = [rollout_row(row, [21, 22, 23], 1.0, trained=True) for row in prompts]
    objective = PolicyGradientObjective(model, settings=GrpoSettings(), vision=vision.family)
    with torch.no_grad():
        got = objective(collate(rows, 0, padding_free=padding_free), mode="token_logps")
    want = []
    for prompt, row in zip(prompts, rows):
        ids = torch.tensor([row["input_ids"]])
        inputs = vision.family.model_inputs(_images(prompt))
        inputs |= vision.family.token_inputs(ids, vision.model_config)
        with torch.no_grad():
            logps = model(input_ids=ids, **inputs).logits[0].float().log_softmax(-1)
        want += [logps[i, t].item() for i, t in enumerate(row["targets"]) if t != -100]
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    images_dropped = collate(rows, 0, padding_free=padding_free) | {"images": None}
    with torch.no_grad():  # negative control: the text decoder alone scores differently
        text_only = objective(images_dropped, mode="token_logps")
    assert (text_only - got).abs().max() > 1e-4


def test_banned_tokens_are_never_chosen(qwen):
    """grpo bans a vision-language policy's image token from its completions (a sampled one
    would make the training forward look for image features): greedy takes the next best
    token instead, sampling never draws it."""
    from keel.infer.batch_generate import GroupRequest, Sampling, generate_groups

    model, tokenizer, _, prompts = qwen
    request = [GroupRequest(prompt_ids=list(prompts[2]["input_ids"]), n=4, seed=3)]

    def completions(**sampling) -> list[list[int]]:
        (group,) = generate_groups(
            model, tokenizer, request, Sampling(max_tokens=8, **sampling), max_batch_size=4
        )
        return [c.token_ids for c in group]

    free = completions(temperature=0.0)[0]
    banned = completions(temperature=0.0, banned=(free[0],))[0]
    assert banned[0] != free[0]
    drawn = completions(temperature=1.0)
    common = tuple({token for tokens in drawn for token in tokens})  # every token it drew
    for tokens in completions(temperature=1.0, banned=common):
        assert not set(tokens) & set(common)


def test_reward_functions_receive_each_prompts_images(qwen, tmp_path, monkeypatch):
    """TRL passes an image dataset's column to the reward functions: each completion gets
    its prompt's images, decoded (RGB PIL images, in placeholder order), under the images
    column's name; [] for a prompt without. A file path is read again from any working
    directory, an inline image (a data URL) from the prompt row itself."""
    import base64
    import io

    import numpy as np

    from keel.rewards import TrainerState
    from keel.train.rollout_rewards import reward_inputs

    _, tokenizer, vision, _ = qwen
    pictures = [make_image(seed=4, size=(56, 56)), make_image(seed=5, size=(84, 56))]
    pictures[0].save(tmp_path / "relative.png")
    encoded = io.BytesIO()
    pictures[1].save(encoded, format="PNG")
    inline = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    rows = [
        {"prompt": "<image><image>Same?", "pictures": ["relative.png", inline], "answer": 1},
        {"prompt": "No picture.", "answer": 0},
    ]
    prompts = _prompt_rows(tmp_path, rows, tokenizer, vision, columns={"images": "pictures"})
    monkeypatch.chdir(tmp_path.parent)  # the relative path is the dataset folder's
    completions = [([5, 6], "yes"), ([7], "no")] * 2  # two per prompt
    inputs = reward_inputs(prompts, [0, 1], completions, TrainerState(global_step=3))
    got = inputs.columns["pictures"]
    assert [len(images) for images in got] == [2, 2, 0, 0]
    for images in got[:2]:
        for image, want in zip(images, pictures):
            assert image.mode == "RGB" and image.size == want.size
            assert np.array_equal(np.asarray(image), np.asarray(want))
    assert inputs.columns["answer"] == [1, 1, 0, 0]
    assert "images" not in inputs.columns
    assert inputs.completions == ["yes", "no", "yes", "no"]
    # an image file gone since the data was prepared: an error naming the prompt row
    (tmp_path / "relative.png").unlink()
    with pytest.raises(ImageError, match="prompt row 0's images, read again for the reward"):
        reward_inputs(prompts, [0, 1], completions, TrainerState(global_step=3))
