"""keel.infer.generate: streaming pieces add up to the reply; greedy equals plain generate()."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model

from keel.infer.generate import generate_reply

MESSAGES = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_tiny_model(len(tiny_tokenizer)).eval()


def test_stream_pieces_concatenate_to_reply(model, tiny_tokenizer):
    pieces = []
    reply = generate_reply(model, tiny_tokenizer, MESSAGES, max_new_tokens=16, stream=pieces.append)
    assert reply and len(pieces) > 1
    assert "".join(pieces) == reply


def test_greedy_matches_plain_generate(model, tiny_tokenizer):
    inputs = tiny_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(
        **inputs,
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=tiny_tokenizer.eos_token_id,
    )  # [1, T + new]
    new = out[0, inputs["input_ids"].shape[1] :]
    expected = tiny_tokenizer.decode(new, skip_special_tokens=True)
    assert generate_reply(model, tiny_tokenizer, MESSAGES, max_new_tokens=16) == expected


def test_sampling_is_seeded(model, tiny_tokenizer):
    def sample():
        torch.manual_seed(0)
        pieces = []
        text = generate_reply(
            model,
            tiny_tokenizer,
            MESSAGES,
            max_new_tokens=8,
            temperature=0.8,
            top_p=0.9,
            stream=pieces.append,
        )
        return text, pieces

    first, pieces = sample()
    assert sample()[0] == first
    assert "".join(pieces) == first


def test_incomplete_utf8_is_held_back(tiny_tokenizer):
    from keel.infer.generate import _TextCollector

    pieces = []
    collector = _TextCollector(tiny_tokenizer, pieces.append)
    collector.put(torch.tensor([[1, 2, 3]]))  # the prompt: ignored
    for token in tiny_tokenizer.encode("é ok", add_special_tokens=False):
        collector.put(torch.tensor([token]))
    collector.end()
    assert pieces[0] == "é"  # the first byte alone decodes to U+FFFD and must not be shown
    assert "".join(pieces) == "é ok"
