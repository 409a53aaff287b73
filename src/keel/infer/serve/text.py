"""Turn a growing list of token ids into text pieces, stopping at stop strings."""

from __future__ import annotations


class TextTracker:
    """The reply so far, released in pieces that never contain (or end in the start of) a
    stop string, so a streamed reply equals the non-streamed one.

    The whole reply is decoded at each token rather than token by token: that keeps
    multi-token characters and tokenizer spacing right. Text ending in an incomplete UTF-8
    sequence ("\\ufffd") waits for the next token.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = ""  # text already released
        self.text = ""  # text decoded so far (possibly more than was released)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add one token; return (new text to release, whether a stop string was reached).

        After a stop string, the released text ends just before it and nothing more comes.
        """
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.startswith(self.sent):
            # Decoding more tokens rewrote text already released (rare cleanup rules): keep
            # what the client saw and continue after it.
            text = self.sent + text[len(self.sent) :]
        self.text = text
        if text.endswith("\ufffd"):
            return "", False
        # Held-back text means no earlier stop can start before len(self.sent).
        hits = [i for i in (text.find(s, len(self.sent)) for s in self.stop) if i >= 0]
        if hits:
            return self._release(min(hits)), True
        return self._release(len(text) - self._partial_stop(text)), False

    def flush(self) -> str:
        """Release everything held back (the reply ended without completing a stop)."""
        return self._release(len(self.text))

    def _partial_stop(self, text: str) -> int:
        # Length of the longest tail of `text` that could still grow into a stop string.
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-size:]):
                    longest = size
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, len(self.sent))
        piece = self.text[len(self.sent) : end]
        self.sent = self.text[:end]
        return piece
