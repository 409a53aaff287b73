"""Terminal chat: one prompt (`keel chat --prompt`) or an interactive session with history."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from keel.infer.generate import ChatImages, generate_reply
from keel.infer.vision import require_vision, with_images_first

HELP = "Type a message. /reset clears the conversation, /exit (or Ctrl-D) quits."


def chat_images(model, paths: list[str], *, base_dir: Path) -> ChatImages:
    """The images of `keel chat --image` (paths relative to `base_dir`), decoded, with the
    model's image processing; KeelError naming the model when it takes no images, or
    naming the image that cannot be read."""
    from keel.models.vision.images import load_image

    vision = require_vision(model)
    return ChatImages(tuple(load_image(path, base_dir) for path in paths), vision)


def _start(system: str | None) -> list[dict]:
    # No system message means the chat template's own default (SmolLM2 names itself there).
    return [{"role": "system", "content": system}] if system else []


def _user(text: str, images: ChatImages | None) -> dict:
    count = len(images.images) if images is not None else 0
    return {"role": "user", "content": with_images_first(text, count)}


def _writer(output: TextIO) -> Callable[[str], None]:
    def write(piece: str) -> None:
        output.write(piece)
        output.flush()  # show each piece now, not when the line buffer fills

    return write


def chat_once(
    model, tokenizer, prompt: str, *, system: str | None, output: TextIO | None = None, **gen
) -> str:
    """Answer one prompt, streaming the reply to `output` (default stdout); return the reply.

    `gen` goes to `generate_reply` (images, max_new_tokens, temperature, top_p). Images go
    to the prompt's `<image>` placeholders, or before its text when it has none.
    """
    output = output if output is not None else sys.stdout
    messages = [*_start(system), _user(prompt, gen.get("images"))]
    reply = generate_reply(model, tokenizer, messages, stream=_writer(output), **gen)
    output.write("\n")
    output.flush()
    return reply


def interactive_chat(
    model,
    tokenizer,
    *,
    system: str | None,
    input_fn: Callable[[str], str] = input,
    output: TextIO | None = None,
    **gen,
) -> None:
    """Chat until /exit or end of input, keeping the conversation as context.

    Every turn sends the whole history (system, then user/assistant pairs) to the model;
    "/reset" starts over. Ctrl-C during a reply stops that reply and drops the turn.
    Images (`gen["images"]`) go with the first user turn.
    """
    output = output if output is not None else sys.stdout
    write = _writer(output)
    messages = _start(system)
    write(HELP + "\n")
    while True:
        try:
            line = input_fn(">>> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return
        if text == "/reset":
            messages = _start(system)
            write("(conversation cleared)\n")
            continue
        # The images belong to the first user turn; every turn resends the whole history.
        first = not any(m["role"] == "user" for m in messages)
        turn = [*messages, _user(text, gen.get("images") if first else None)]
        try:
            reply = generate_reply(model, tokenizer, turn, stream=write, **gen)
        except KeyboardInterrupt:
            write("\n(interrupted; this turn was not kept)\n")
            continue
        write("\n")
        messages = [*turn, {"role": "assistant", "content": reply}]
