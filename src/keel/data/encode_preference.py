"""Pairs and KTO samples → tokens, beside the SFT encoder (`keel.data.encode.RowEncoder`).

Each sequence is the prompt and one answer, rendered as one conversation with the chat
template and masked as SFT masks an assistant turn, keeping only the last (the answer's)
span: the answer's tokens through its end-of-turn token are targets, nothing before. A pair
becomes two sequences laid end to end, chosen then rejected (`seq_lens`, `labels` [1, 0]);
a KTO sample one sequence with `labels` [1] or [0] and `prompt_len`, the number of tokens
before its answer, from which keel.data.kto builds the mismatched KL sequences.

data.cutoff_len bounds each sequence. Over it, data.overlength applies to the whole pair:
drop or error as in SFT; truncate cuts the answers only: a prompt that leaves no room for
one answer token rejects the row (a cut prompt would train on a question never asked).

With a vision-language model a pair's images (its prompt's) are in both sequences: the row's
`image_blobs` are the chosen sequence's, then the rejected one's (keel.data.vision). Since
truncate never cuts a prompt, it never cuts an image. A KTO sample's images are its
prompt's, which its mismatched sequence (keel.data.kto) starts with too.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from keel.data.encode import EncodeSettings, RowEncoder, output_features
from keel.data.encode_prompt import PromptEncoder
from keel.data.formats import Example, RowError
from keel.data.preference import row_to_kto, row_to_pair
from keel.data.template import TemplateMismatch, encode_sft, shift_targets
from keel.data.vision import (
    ImageTokens,
    encode_with_images,
    image_columns,
    refuse_images,
    vision_features,
)
from keel.stages.registry import get_stage


class _Refused(Exception):
    """A row that is not kept: its status (dropped, overlength, rejected) and reason."""

    def __init__(self, status: str, reason: str = "", length: int = 0):
        super().__init__(reason)
        self.outcome = {"status": status, "reason": reason, "length": length}


@dataclass(frozen=True)
class _Sequence:
    ids: list[int]
    targets: list[int]
    prompt_len: int  # tokens before the answer's first token
    truncated: bool
    images: ImageTokens | None = None  # a vision-language run's images of this sequence


class _PreferenceEncoder(RowEncoder, ABC):
    def encode_row(self, row: dict) -> dict:
        try:
            return self._encode(row)
        except RowError as e:
            return {"status": "rejected", "reason": str(e)}
        except TemplateMismatch as e:
            return {"status": "template", "reason": str(e)}
        except _Refused as r:
            return r.outcome

    @abstractmethod
    def _encode(self, row: dict) -> dict:
        """The encoded row; raises RowError, TemplateMismatch or _Refused."""

    def _sequences(
        self, prompt: list[dict], answers: list[str], images: tuple = ()
    ) -> tuple[list[_Sequence], int]:
        """One sequence per answer, the over-length policy applied to them together; and
        the longest one's length before any cut."""
        s = self.settings
        conversations = [[*prompt, {"role": "assistant", "content": a}] for a in answers]
        if s.vision is None:
            encoded = [
                (*encode_sft(self.tokenizer, s.template, c, True), None) for c in conversations
            ]
        else:
            encoded = [
                encode_with_images(self.tokenizer, s, Example(c, images), last_only=True)
                for c in conversations
            ]
        length = max(len(ids) for ids, _, _ in encoded)
        if length > s.cutoff_len and s.overlength != "truncate":
            raise _Refused("dropped" if s.overlength == "drop" else "overlength", "", length)
        return [self._fit(ids, mask, length, found) for ids, mask, found in encoded], length

    def _fit(self, ids: list[int], mask: list[bool], length: int, images=None) -> _Sequence:
        cutoff = self.settings.cutoff_len
        if True not in mask:
            raise _Refused("rejected", "all labels masked: the answer has no tokens", length)
        prompt_len = mask.index(True)
        truncated = len(ids) > cutoff
        if truncated and prompt_len >= cutoff:
            raise _Refused(
                "rejected",
                f"the prompt alone is {prompt_len} tokens, leaving no room for the answer in "
                f"cutoff_len {cutoff} (data.overlength=truncate cuts answers, never the "
                f"prompt); raise data.cutoff_len or shorten the prompt",
                length,
            )
        ids, mask = ids[:cutoff], mask[:cutoff]
        images = images.cut(cutoff) if images is not None and truncated else images
        return _Sequence(ids, shift_targets(ids, mask), prompt_len, truncated, images)


# The stage whose loss reads a pair's margin: rm (TRL's RewardTrainer). The others have none.
MARGIN_STAGE = "rm"
MARGIN_COLUMN = "margin"  # TRL's name; optional per dataset


def pair_margin(row: dict) -> float:
    """How much higher the chosen answer must score (the row's `margin`; 0 without one)."""
    value = row.get(MARGIN_COLUMN)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RowError(
            f"field '{MARGIN_COLUMN}' must be a finite number (how much higher chosen must "
            f"score), got {type(value).__name__} {value!r}"
        )
    return float(value)


class PairEncoder(_PreferenceEncoder):
    """dpo/orpo/simpo/rm: a row → chosen then rejected, `seq_lens` and `labels` [1, 0]
    (rm: and `margin` [m])."""

    def features(self):
        from datasets import List, Value

        pair = {"seq_lens": List(Value("int32")), "labels": List(Value("int32"))}
        if self.settings.stage == MARGIN_STAGE:
            pair["margin"] = List(Value("float32"))
        return output_features(pair | vision_features(self.settings.vision))

    def _encode(self, row: dict) -> dict:
        pair = row_to_pair(row, self.settings.spec)
        if self.settings.vision is None:
            refuse_images(Example(pair.prompt, pair.images))
        answers = [pair.chosen, pair.rejected]
        (chosen, rejected), length = self._sequences(pair.prompt, answers, pair.images)
        out = {
            "status": "truncated" if chosen.truncated or rejected.truncated else "ok",
            "length": length,
            "input_ids": chosen.ids + rejected.ids,
            "targets": chosen.targets + rejected.targets,
            "seq_lens": [len(chosen.ids), len(rejected.ids)],
            "labels": [1, 0],
        }
        if self.settings.stage == MARGIN_STAGE:
            out["margin"] = [pair_margin(row)]
        if self.settings.vision is not None:
            sequences = [(chosen.ids, chosen.images), (rejected.ids, rejected.images)]
            out |= image_columns(self.settings.vision, sequences)
            out["image_files"] = list(chosen.images.files)
        return out


class KtoEncoder(_PreferenceEncoder):
    """kto: a row → one sequence, `labels` [1] (desirable) or [0], and `prompt_len`; with a
    vision-language model its prompt's images (keel.data.kto gives its mismatched sequence
    the same ones)."""

    def features(self):
        from datasets import List, Value

        sample = {"labels": List(Value("int32")), "prompt_len": Value("int64")}
        return output_features(sample | vision_features(self.settings.vision))

    def _encode(self, row: dict) -> dict:
        sample = row_to_kto(row, self.settings.spec)
        if self.settings.vision is None:
            refuse_images(Example(sample.prompt, sample.images))
        (seq,), length = self._sequences(sample.prompt, [sample.completion], sample.images)
        out = {
            "status": "truncated" if seq.truncated else "ok",
            "length": length,
            "input_ids": seq.ids,
            "targets": seq.targets,
            "labels": [int(sample.desirable)],
            "prompt_len": seq.prompt_len,
        }
        if self.settings.vision is not None:
            out |= image_columns(self.settings.vision, [(seq.ids, seq.images)])
            out["image_files"] = list(seq.images.files)
        return out


def encoder_for(tokenizer, settings: EncodeSettings) -> RowEncoder:
    """The row encoder for the data unit of `settings.stage`."""
    unit = get_stage(settings.stage).unit
    if unit == "pair":
        return PairEncoder(tokenizer, settings)
    if unit == "sample":
        return KtoEncoder(tokenizer, settings)
    if unit == "prompt":
        return PromptEncoder(tokenizer, settings)
    return RowEncoder(tokenizer, settings)
