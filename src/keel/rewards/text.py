"""Built-in verifiable rewards, importable as `keel.rewards:<name>`.

Each follows TRL's reward-function signature: keyword arguments `completions` (and any
dataset column it names, e.g. `answer`), `**kwargs` for the rest, and one float (or None:
unscorable) per completion. Completions are text, or `[{"role": "assistant", "content":
text}]` for conversational prompts.
"""

from __future__ import annotations

import re

# "<think>...</think>" (optional) then exactly one "<answer>...</answer>", nothing else; the
# tempered dots stop a second think/answer block from hiding inside the first.
_THINK = r"<think>(?:(?!</?think>).)*</think>\s*"
_ANSWER = r"<answer>((?:(?!</?answer>).)*)</answer>"
_FORMAT = re.compile(rf"(?:{_THINK})?{_ANSWER}", re.DOTALL)
_ANSWER_TAG = re.compile(_ANSWER, re.DOTALL)


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or the messages' contents joined."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


# Named `format` (shadowing the builtin in this module only): configs spell it keel.rewards:format
def format(completions: list, **kwargs) -> list[float]:
    """1.0 where the completion is an optional `<think>...</think>` followed by exactly one
    `<answer>...</answer>` (surrounding whitespace allowed), else 0.0."""
    return [1.0 if _FORMAT.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


def exact_match(completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 where the completion's answer equals str(answer) (dataset column `answer`), else
    0.0; None (unscorable) where the row has no answer.

    The completion's answer is the text inside its single `<answer>...</answer>`, or the
    whole completion when it has no such tag; both sides are compared stripped of
    surrounding whitespace.
    """
    return [_match(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]


def _match(text: str, answer) -> float | None:
    if answer is None:
        return None
    tagged = _ANSWER_TAG.findall(text)
    given = tagged[0] if len(tagged) == 1 else text
    return 1.0 if given.strip() == str(answer).strip() else 0.0
