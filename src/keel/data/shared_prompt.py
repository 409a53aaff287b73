"""Rows whose sequences share a prompt laid out so that the prompt is computed once: grpo's
rollout rows (`share_prompts`) and a preference pair's chosen and rejected sequences
(`share_pair_prompts`, dpo, orpo, simpo and rm).

A grpo micro-batch holds G completions of each of its prompts, each row the prompt followed
by one completion. Laid end to end (padding-free), the prompt's tokens would run through the
model G times; with short completions that is most of the step's work. `share_prompts`
instead lays each run of consecutive rows with the same prompt out as one *group*:

    [p_0 .. p_{P-2}] [p_{P-1} c1_0 .. c1_{n1-1}] [p_{P-1} c2_0 ..] ...
     the shared prefix  segment of completion 1    segment of completion 2

Each segment repeats the prompt's last token (one token per completion), so every position
keeps the one target it has in the row (the token after it): targets, old log-probs and
sequence numbers stay aligned with the input ids, and the objective needs no change.
Positions continue the prefix (a segment starts at P - 1); keel's varlen attention
(keel.models.attention, `PREFIX_GROUPS`) lets each segment see the prefix and itself only,
so every target token gets the log-prob it gets in its own row, at the work of
P - 1 + sum(n_i + 1) tokens instead of sum(P + n_i).

A pair is the same with G = 2: its chosen and rejected sequences render the same prompt, so
the tokens they begin with before either has a target are laid out once, and each sequence
goes on from there; its sequence numbers (chosen 2i, rejected 2i + 1) are unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from keel.data.encode import IGNORE_INDEX

PROMPT_LEN = "prompt_len"  # a rollout row's field: its prompt's length in tokens
# Per group: (prefix length, each segment's length); the attention keyword's value
Groups = tuple[tuple[int, tuple[int, ...]], ...]
_PER_TOKEN = ("input_ids", "targets", "position_ids", "old_logps")
_PER_SEQUENCE = ("advantages", "kept")
_PAIR_TOKENS = ("input_ids", "targets", "position_ids")  # what a pair's sequences lay out


def can_share(rows: list[dict]) -> bool:
    """Whether `rows` are rollout rows that say where their prompt ends."""
    return bool(rows) and all(PROMPT_LEN in row for row in rows)


def share_prompts(rows: list[dict]) -> tuple[dict, Groups]:
    """`rows` (rollout rows, each with `prompt_len`) as one row in the grouped layout above,
    and its groups. Consecutive rows whose prompts are the same token for token form one
    group; the merged row's sequences (`advantages`, `kept`) keep the rows' order."""
    merged: dict = {key: [] for key in (*_PER_TOKEN, *_PER_SEQUENCE) if key in rows[0]}
    merged["num_targets"] = sum(row["num_targets"] for row in rows)
    groups = []
    for members in _runs(rows):
        cut = members[0][PROMPT_LEN] - 1  # the prefix: the prompt but its last token
        for key in _PER_TOKEN:
            if key in merged:
                merged[key] += members[0][key][:cut]
        for row in members:
            for key in _PER_TOKEN:
                if key in merged:
                    merged[key] += row[key][cut:]
            for key in _PER_SEQUENCE:
                if key in merged:
                    merged[key] += row[key]
        groups.append((cut, tuple(len(row["input_ids"]) - cut for row in members)))
    return merged, tuple(groups)


def sequence_index(groups: Groups) -> list[int]:
    """The merged row's sequence number of each token: -1 on a prefix (it has no targets),
    then 0, 1, ... for the segments in order."""
    index, number = [], 0
    for prefix, segments in groups:
        index += [-1] * prefix
        for length in segments:
            index += [number] * length
            number += 1
    return index


def unshare(values: Sequence[float], rows: list[dict]) -> list[list[float]]:
    """Per-token `values` of the merged row ([T], aligned with its input ids) back into each
    row's own layout (aligned with the row's input ids; 0.0 on its prompt but the last
    token, where a row has no targets)."""
    out, start = [], 0
    for members in _runs(rows):
        cut = members[0][PROMPT_LEN] - 1
        start += cut
        for row in members:
            end = start + len(row["input_ids"]) - cut
            out.append([0.0] * cut + [float(v) for v in values[start:end]])
            start = end
    return out


def _runs(rows: list[dict]) -> list[list[dict]]:
    """Consecutive rows with the same prompt, in order."""
    runs: list[list[dict]] = []
    for row in rows:
        if runs and _same_prompt(runs[-1][0], row):
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def _same_prompt(first: dict, row: dict) -> bool:
    length = first[PROMPT_LEN]
    return row[PROMPT_LEN] == length and row["input_ids"][:length] == first["input_ids"][:length]


def share_pair_prompts(row: dict) -> tuple[dict, Groups]:
    """A padding-free row of preference pairs (each pair its chosen then its rejected
    sequence, position ids restarting with each sequence) laid out with each pair's prompt
    once: a group per pair, its prefix the tokens both sequences begin with before either
    has a target, its two segments the rest of each sequence. Targets, position ids (a
    segment continues the prefix's) and the per-sequence values (labels, reference
    log-probs) stay aligned; the sequences keep their order."""
    merged: dict = {key: [] for key in _PAIR_TOKENS}
    groups = []
    ends = list(itertools.accumulate(sample_lengths(row["position_ids"])))
    sequences = [slice(start, end) for start, end in zip([0, *ends], ends)]
    assert len(sequences) % 2 == 0, f"{len(sequences)} sequences are not whole pairs"
    for chosen, rejected in zip(sequences[0::2], sequences[1::2]):
        pair = [{key: row[key][s] for key in _PAIR_TOKENS} for s in (chosen, rejected)]
        cut = _common_prompt(*pair)
        for key in _PAIR_TOKENS:  # the chosen sequence whole, then the rejected one's rest
            merged[key] += pair[0][key] + pair[1][key][cut:]
        groups.append(
            (cut, (chosen.stop - chosen.start - cut, rejected.stop - rejected.start - cut))
        )
    return {**row, **merged}, tuple(groups)


def sample_lengths(position_ids: Sequence[int]) -> tuple[int, ...]:
    """Lengths of the samples of a row whose position ids restart at 0 with each one."""
    starts = [i for i, p in enumerate(position_ids) if p == 0 and i > 0]
    bounds = [0, *starts, len(position_ids)]
    return tuple(int(end - start) for start, end in zip(bounds, bounds[1:]))


def _common_prompt(chosen: dict, rejected: dict) -> int:
    """How many leading tokens two sequences share before either has a target (the prompt
    but its last token, which carries the first answer token's target)."""
    firsts = [next((i for i, t in enumerate(s["targets"]) if t != IGNORE_INDEX), len(s["targets"]))
              for s in (chosen, rejected)]  # fmt: skip
    limit = min(firsts)
    cut = 0
    while cut < limit and chosen["input_ids"][cut] == rejected["input_ids"][cut]:
        cut += 1
    return cut
