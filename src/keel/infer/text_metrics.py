"""How close generated answers are to the dataset's: the scores LLaMA-Factory's predict
reports (`predict_with_generate`), computed as theirs are, plus exact match.

- BLEU-4: sentence BLEU of the answer's characters against the label's (spaces included),
  four n-gram orders weighted equally, NIST geometric smoothing (NLTK's `method3`: the k-th
  order with no match counts 1 / (2^k x its n-grams)), the brevity penalty of the label's
  length; 0 when not one character matches.
- ROUGE-1, ROUGE-2: F1 of the distinct word n-grams the answer and the label share (as the
  `rouge-chinese` package counts them); ROUGE-L: F1 of their longest common word
  subsequence. Words are jieba's segmentation when jieba is installed (theirs is), else runs
  of ASCII letters and digits, with every other character that is not a space a word of its
  own (jieba's result on English text; Chinese then scores per character). An empty answer
  or label scores 0.
- Exact match: the answer equals the label once both are stripped of surrounding spaces.

Each sample's score is x100 and rounded to 4 places, then averaged over the labelled
samples, as theirs.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable

_WORD = re.compile(r"[A-Za-z0-9]+(?:\.[0-9]+)?%?|\S")


def words(text: str) -> list[str]:
    """The words ROUGE compares (see the module)."""
    try:
        import jieba  # noqa: PLC0415 - optional: LLaMA-Factory's Chinese segmentation
    except ImportError:
        return _WORD.findall(text)
    jieba.setLogLevel(60)  # its "Building prefix dict" lines are not the user's concern
    return " ".join(jieba.cut(text)).split()


def bleu4(answer: str, label: str) -> float:
    """Sentence BLEU-4 of `answer`'s characters against `label`'s, in [0, 1]."""
    hypothesis, reference = list(answer), list(label)
    matches, totals = [], []
    for n in range(1, 5):
        ours, theirs = _ngrams(hypothesis, n), _ngrams(reference, n)
        matches.append(sum(min(count, theirs[gram]) for gram, count in ours.items()))
        totals.append(max(1, sum(ours.values())))
    if matches[0] == 0:
        return 0.0
    precisions, misses = [], 0
    for matched, total in zip(matches, totals):
        if matched == 0:
            misses += 1
            precisions.append(1 / (2**misses * total))
        else:
            precisions.append(matched / total)
    return _brevity(len(reference), len(hypothesis)) * math.exp(
        math.fsum(0.25 * math.log(p) for p in precisions)
    )


def _brevity(reference: int, hypothesis: int) -> float:
    if hypothesis > reference:
        return 1.0
    if hypothesis == 0:
        return 0.0
    return math.exp(1 - reference / hypothesis)


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def rouge(answer_words: list[str], label_words: list[str]) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 and ROUGE-L F1 of two word lists, each in [0, 1]."""
    if not answer_words or not label_words:
        return {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0}
    scores = {}
    for n in (1, 2):
        ours, theirs = set(_ngrams(answer_words, n)), set(_ngrams(label_words, n))
        scores[f"rouge-{n}"] = _f1(len(ours & theirs), len(ours), len(theirs))
    common = _lcs_length(answer_words, label_words)
    scores["rouge-l"] = _f1(common, len(answer_words), len(label_words))
    return scores


def _f1(overlap: int, answer: int, label: int) -> float:
    precision = overlap / answer if answer else 0.0
    recall = overlap / label if label else 0.0
    return 2.0 * precision * recall / (precision + recall + 1e-8)  # rouge-chinese's epsilon


def _lcs_length(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def exact_match(answer: str, label: str) -> float:
    return float(answer.strip() == label.strip())


def score_answers(pairs: Iterable[tuple[str, str]]) -> dict[str, float]:
    """Each score's mean over (answer, label) pairs (see the module); {} for no pairs."""
    totals: Counter = Counter()
    count = 0
    for answer, label in pairs:
        count += 1
        scores = {
            "bleu-4": bleu4(answer, label),
            **rouge(words(answer), words(label)),
            "exact_match": exact_match(answer, label),
        }
        totals.update({name: round(value * 100, 4) for name, value in scores.items()})
    if not count:
        return {}
    names = ("bleu-4", "rouge-1", "rouge-2", "rouge-l", "exact_match")
    return {name: round(totals[name] / count, 4) for name in names}
