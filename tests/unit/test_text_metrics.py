"""keel predict's scores equal LLaMA-Factory's: BLEU-4 and ROUGE-1/2/L as their
compute_metrics gives them (NLTK's sentence_bleu with method3 on characters, rouge-chinese
on jieba's words), on English text, where keel's word rule is jieba's result."""

from __future__ import annotations

import math

import pytest

from keel.infer.text_metrics import bleu4, exact_match, rouge, score_answers, words

# (answer, label) -> their per-sample scores x100 (rounded to 4 places, as they round), from
# nltk 3.9 sentence_bleu(..., smoothing_function=SmoothingFunction().method3) and
# rouge_chinese 1.0.3 Rouge().get_scores over jieba 0.42 words, run once outside this suite
THEIRS = [
    ("The cat sat on the mat.", "The cat is on the mat.", (79.4484, 85.7143, 66.6667, 85.7143)),
    (
        "Paris is the capital of France.",
        "The capital of France is Paris.",
        (83.0239, 85.7143, 33.3333, 57.1429),
    ),
    ("I don't know, maybe 3.5 or 4?", "It is 4.", (4.0276, 13.3333, 0.0, 13.3333)),
    ("", "Something", (0.0, 0.0, 0.0, 0.0)),
    ("yes", "no", (0.0, 0.0, 0.0, 0.0)),
    ("Hello hello hello world", "hello world", (43.9371, 80.0, 50.0, 66.6667)),
    ("ok", "ok", (59.4604, 100.0, 0.0, 100.0)),  # BLEU's brevity: 2 characters, no 3-grams
    (
        "e-mail me at x@y.com, thanks!",
        "Email me: x@y.com",
        (42.8987, 57.1429, 42.1053, 57.1429),
    ),
    ("Ab", "Abc", (36.0645, 0.0, 0.0, 0.0)),
]

# jieba's words on English: ASCII letter and digit runs (a decimal and a percent kept whole),
# every other character that is not a space alone
JIEBA_WORDS = [
    ("About 50% of 3.14 is v1.2.3", ["About", "50%", "of", "3.14", "is", "v1.2", ".", "3"]),
    ("Hi—there, naïve café", ["Hi", "—", "there", ",", "na", "ï", "ve", "caf", "é"]),
    ("I don't\nknow\tit", ["I", "don", "'", "t", "know", "it"]),
]


@pytest.fixture(autouse=True)
def _without_jieba(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "jieba", None)  # keel's own word rule, installed or not


@pytest.mark.parametrize("answer,label,scores", THEIRS)
def test_scores_equal_llamafactory(answer, label, scores):
    ours = (bleu4(answer, label), *rouge(words(answer), words(label)).values())
    assert [round(s * 100, 4) for s in ours] == list(scores)


@pytest.mark.parametrize("text,expected", JIEBA_WORDS)
def test_words_are_jiebas_on_english(text, expected):
    assert words(text) == expected


def test_identical_text_scores_full_marks_and_mean_over_samples():
    text = "The quick brown fox jumps over the lazy dog."
    assert bleu4(text, text) == pytest.approx(1.0)
    assert rouge(words(text), words(text)) == pytest.approx(
        {"rouge-1": 1.0, "rouge-2": 1.0, "rouge-l": 1.0}, abs=1e-7
    )
    assert exact_match(f"  {text}\n", text) == 1.0 and exact_match(text, text[:-1]) == 0.0
    pairs = [(text, text), ("yes", "no")]
    means = score_answers(pairs)
    assert means == {
        "bleu-4": 50.0,
        "rouge-1": 50.0,
        "rouge-2": 50.0,
        "rouge-l": 50.0,
        "exact_match": 50.0,
    }
    assert score_answers([]) == {}


def test_bleu_is_the_geometric_mean_with_nist_smoothing():
    # "abcd" against "abce": 3 of 4 characters, 2 of 3 bigrams, 1 of 2 trigrams, 0 of 1
    # 4-gram (smoothed to 1 / (2 x 1)); same length: no brevity penalty
    expected = math.exp(0.25 * sum(math.log(p) for p in (3 / 4, 2 / 3, 1 / 2, 1 / 2)))
    assert bleu4("abcd", "abce") == pytest.approx(expected)
    # shorter than the label: exp(1 - 5/4) times the same precisions
    assert bleu4("abcd", "abcde") == pytest.approx(math.exp(1 - 5 / 4) * 1.0)
