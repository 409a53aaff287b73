"""Terminal chat: one prompt (`keel chat --prompt`) or an interactive session with history."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from keel.infer.generate import generate_reply

HELP = "Type a message. /reset clears the conversation, /exit (or Ctrl-D) quits."


def _start(system: str | None) -> list[dict]:
    # No system message means the chat template's own default (SmolLM2 names itself there).
    return [{"role": "system", "content": system}] if system else []


def _writer(output: TextIO) -> Callable[[str], None]:
    def write(piece: str) -> None:
        output.write(piece)
        output.flush()  # show each piece now, not when the line buffer fills

    return write


def chat_once(
    model, tokenizer, prompt: str, *, system: str | None, output: TextIO | None = None, **gen
) -> str:
    """Answer one prompt, streaming the reply to `output` (default stdout); return the reply.

    `gen` goes to `generate_reply` (max_new_tokens, temperature, top_p).
    """
    output = output if output is not None else sys.stdout
    messages = [*_start(system), {"role": "user", "content": prompt}]
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
        turn = [*messages, {"role": "user", "content": text}]
        try:
            reply = generate_reply(model, tokenizer, turn, stream=write, **gen)
        except KeyboardInterrupt:
            write("\n(interrupted; this turn was not kept)\n")
            continue
        write("\n")
        messages = [*turn, {"role": "assistant", "content": reply}]
