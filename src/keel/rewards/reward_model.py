"""A sequence-classification model used as a reward: its score of prompt + completion."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keel.errors import ModelError
from keel.models.loading import load_tokenizer
from keel.models.safetensors_files import check_model_dir

_BATCH = 16  # texts scored per forward: bounds the activations of long completions


@dataclass(frozen=True)
class RewardModel:
    """Scores completions as TRL does: the text of prompt + completion (the chat template
    over prompt messages + the assistant's reply for conversational prompts), no special
    tokens added, right padding, score = logits[:, 0] at the last non-pad token."""

    model: Any  # a transformers *ForSequenceClassification, in eval mode
    tokenizer: Any
    device: torch.device

    def __call__(self, *, prompts: list, completions: list, **_columns) -> list[float]:
        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), _BATCH):
                encoded = self.tokenizer(
                    texts[start : start + _BATCH],
                    return_tensors="pt",
                    padding=True,
                    padding_side="right",
                    add_special_tokens=False,
                ).to(self.device)
                scores += self.model(**encoded).logits[:, 0].float().tolist()
        return scores

    def _text(self, prompt, completion) -> str:
        if isinstance(prompt, str):
            return prompt + (completion if isinstance(completion, str) else _joined(completion))
        reply = completion
        if isinstance(completion, str):
            reply = [{"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(list(prompt) + list(reply), tokenize=False)


def _joined(messages: list) -> str:
    return "".join(str(message.get("content") or "") for message in messages)


def load_reward_model(folder: Path, *, device: str = "cpu") -> RewardModel:
    """Load the *ForSequenceClassification model and tokenizer saved in `folder`; a
    ModelError when the folder holds something else (a causal LM would get a random head)."""
    from transformers import AutoModelForSequenceClassification

    architectures = _architectures(folder)
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ModelError(
            f"{folder} holds {', '.join(architectures) or 'no architectures entry'}, not a "
            "reward model (*ForSequenceClassification); train one with train.stage: rm, or "
            "use a reward function (file.py:function)"
        )
    check_model_dir(folder)
    tokenizer = load_tokenizer(folder)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype="auto")
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load the reward model in {folder}: {error}") from error
    if model.config.pad_token_id is None:
        # batches are padded, and the score is read at the last non-pad token
        model.config.pad_token_id = tokenizer.pad_token_id
    return RewardModel(
        model=model.to(device).eval(), tokenizer=tokenizer, device=torch.device(device)
    )


def _architectures(folder: Path) -> list[str]:
    config = folder / "config.json"
    if not config.is_file():
        raise ModelError(f"{folder} has no config.json: not a model folder")
    try:
        return list(json.loads(config.read_text(encoding="utf-8")).get("architectures") or [])
    except (json.JSONDecodeError, AttributeError) as error:
        raise ModelError(f"{config} is not a JSON object: {error}") from error
