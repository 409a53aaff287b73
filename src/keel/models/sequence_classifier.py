"""Write a reward model (train.stage rm) as a Hugging Face *ForSequenceClassification folder.

transformers builds the family's sequence-classification class from a causal LM folder
itself (the backbone's weights carried over under their own names, the output layer
dropped, a `score` Linear(hidden, 1, bias=False) added); keel then puts the trained head in
`score`. The config says `architectures: [<Family>ForSequenceClassification]`, `num_labels`
1 and `pad_token_id` (the class reads each sequence's score at its last non-pad token), so
`AutoModelForSequenceClassification.from_pretrained(folder)` gives keel's scores, and a grpo
run can name the folder as a reward.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from keel.models.adapters import save_model_dir


def sequence_classifier_problem(config) -> str | None:
    """Why a reward model of a model with `config` cannot be written as a
    *ForSequenceClassification folder, or None: a vision-language model (most families have
    no such class; Gemma 3's cannot be built from its folder with a pad token), or a text
    model whose model_type has none in transformers (Granite, OLMoE, Cohere) nor in its own
    code (auto_map)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES,
    )

    from keel.models.vision import family_of

    if family_of(config) is not None:
        return (
            f"train.stage = rm trains text reward models (a *ForSequenceClassification "
            f"model), and {config.model_type} is a vision-language model; use its text-only "
            f"sibling or a text model"
        )
    auto_map = getattr(config, "auto_map", None) or {}
    if config.model_type in CLASSES or "AutoModelForSequenceClassification" in auto_map:
        return None
    return (
        f"train.stage = rm writes a *ForSequenceClassification model (what a grpo reward and "
        f"AutoModelForSequenceClassification load), and transformers has none for "
        f"{config.model_type} ({type(config).__name__}); use a model whose family has one "
        f"(Llama, Qwen2/3, Mistral, Gemma, Phi-3, ...)"
    )


def save_sequence_classifier(
    causal_lm_dir: Path, score_weight: torch.Tensor, tokenizer, out_dir: Path
) -> None:
    """Write `causal_lm_dir`'s backbone with `score_weight` [1, hidden] as its score head
    to `out_dir` (model, config, tokenizer), in the causal LM's own dtype."""
    from transformers import AutoModelForSequenceClassification

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with _quiet_new_head():  # the head it reports as newly initialised is replaced below
        model = AutoModelForSequenceClassification.from_pretrained(
            str(causal_lm_dir), num_labels=1, dtype="auto", pad_token_id=pad
        )
    model.config.get_text_config().pad_token_id = pad
    with torch.no_grad():
        model.score.weight.copy_(score_weight.detach().to("cpu", model.score.weight.dtype))
    save_model_dir(model, tokenizer, out_dir)


@contextmanager
def _quiet_new_head():
    """transformers warns that `score` is newly initialised (it is: keel fills it next)."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
