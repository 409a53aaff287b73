"""Generate one chat reply with the model's own chat template, streaming text as it comes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChatImages:
    """The images of a conversation (PIL, in `<image>` placeholder order) and the model's
    vision processing (keel.models.vision.VisionProcessing) that prepares them."""

    images: tuple
    vision: object


class _TextCollector:
    """A transformers streamer that decodes the reply so far and emits only the new text.

    Decoding all reply tokens each step (not token by token) keeps multi-token characters and
    tokenizer spacing right, so the pieces concatenate to exactly the decoded reply. Text that
    ends in an incomplete UTF-8 sequence ("\\ufffd") is held back until the next token.
    """

    def __init__(self, tokenizer, stream: Callable[[str], None] | None):
        self.tokenizer = tokenizer
        self.stream = stream
        self.ids: list[int] = []
        self.text = ""
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        # generate() first puts the whole prompt, then one new token per step.
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)

    def _emit(self, *, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return
        if not text.startswith(self.text):
            # Decoding more tokens changed text already shown (rare cleanup rules); keep what
            # was shown and continue after it, so the returned text is what the user saw.
            text = self.text + text[len(self.text) :]
        piece = text[len(self.text) :]
        if piece:
            self.text = text
            if self.stream is not None:
                self.stream(piece)


def stop_token_ids(model, tokenizer) -> list[int]:
    # Stop on the tokenizer's eos (e.g. <|im_end|>) and any eos the model's generation
    # config lists; chat models often end turns with a token that is not the pretraining eos.
    ids = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def generate_reply(
    model,
    tokenizer,
    messages: list[dict],
    *,
    images: ChatImages | None = None,
    stream: Callable[[str], None] | None = None,
    **settings,
) -> str:
    """Reply to `messages` (OpenAI-style role/content dicts) and return the reply text.

    `settings`: max_new_tokens (128), temperature (0.0: greedy, else sampling with
    temperature and top_p), top_p (1.0). Stops at eos or after max_new_tokens. Each new
    piece of text is passed to `stream` as soon as it is decoded; the pieces concatenate to
    the returned text. `images` go to the `<image>` placeholders of the messages, in order
    (a vision-language model). The caller sets eval() mode.
    """
    device = next(model.parameters()).device
    _forget_rope_offsets(model)
    if images is None:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        inputs = {key: encoded[key] for key in ("input_ids", "attention_mask")}  # [1, T] each
    else:
        inputs = _image_inputs(model, tokenizer, messages, images)
    inputs = {key: value.to(device) for key, value in inputs.items()}
    collector = _TextCollector(tokenizer, stream)
    model.generate(
        **inputs,
        generation_config=_generation_config(model, tokenizer, **settings),
        streamer=collector,
    )
    return collector.text


def _generation_config(
    model, tokenizer, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0
):
    from transformers import GenerationConfig

    sampling = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_p=top_p if sampling else None,
        eos_token_id=stop_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def _image_inputs(model, tokenizer, messages: list[dict], images: ChatImages) -> dict:
    from keel.infer.vision import encode_with_images

    prompt = encode_with_images(tokenizer, messages, list(images.images), images.vision)
    ids = torch.tensor([prompt.input_ids])  # [1, T]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **prompt.inputs}


def _forget_rope_offsets(model) -> None:
    # Qwen2-VL keeps the last prompt's M-RoPE offsets on the model (generation state);
    # generate() recomputes them at prefill, and clearing them first means no earlier
    # request's offsets can ever reach this one. Text models have no such attribute.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    if hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None
