"""Generate one chat reply with the model's own chat template, streaming text as it comes."""

from __future__ import annotations

from collections.abc import Callable

import torch


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
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stream: Callable[[str], None] | None = None,
) -> str:
    """Reply to `messages` (OpenAI-style role/content dicts) and return the reply text.

    Greedy when temperature == 0, else sampling with temperature and top_p. Stops at eos or
    after max_new_tokens. Each new piece of text is passed to `stream` as soon as it is
    decoded; the pieces concatenate to the returned text. The caller sets eval() mode.
    """
    from transformers import GenerationConfig

    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    device = next(model.parameters()).device
    input_ids = inputs["input_ids"].to(device)  # [1, T]
    attention_mask = inputs["attention_mask"].to(device)  # [1, T]
    sampling = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_p=top_p if sampling else None,
        eos_token_id=stop_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    collector = _TextCollector(tokenizer, stream)
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        streamer=collector,
    )
    return collector.text
