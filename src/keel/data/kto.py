"""KTO's mismatched sequences: the reference point of its loss estimates a KL term from
sequences whose answer does not belong to their prompt.

Sample i's KL sequence is its own prompt followed by the answer of sample j = i + 1
(cyclically, in the order the samples were kept, before the split and packing), taken at
token level: sample i's first `prompt_len` tokens, then sample j's tokens from its own
`prompt_len` on. Only the answer part is trained, as in the sample itself; the answer is
cut where the sequence would pass data.cutoff_len (the prompt always fits: a kept sample
has at least one answer token within cutoff_len). With a vision-language model the KL
sequence holds sample i's images (they are its prompt's) and, for 3-D rotary families,
gets its own positions (`kl_rope_positions`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keel.data.encode import IGNORE_INDEX
from keel.data.packing import gather_ranges
from keel.errors import DataError


def add_kl_sequences(samples: pa.Table, cutoff_len: int) -> pa.Table:
    """`samples` (input_ids, targets, prompt_len, ...) with kl_input_ids and kl_targets (and
    kl_rope_positions when the samples have rope_positions)."""
    n = samples.num_rows
    if n < 2:
        raise DataError(
            f"KTO needs at least 2 usable samples (its KL reference pairs each prompt with "
            f"another sample's answer); the data has {n}: add samples"
        )
    lengths = pc.list_value_length(samples.column("input_ids")).to_numpy().astype(np.int64)
    ids = pc.list_flatten(samples.column("input_ids")).to_numpy()
    targets = pc.list_flatten(samples.column("targets")).to_numpy()
    prompt = samples.column("prompt_len").to_numpy().astype(np.int64)
    assert (prompt >= 1).all() and (prompt < lengths).all(), (
        "every sample has a prompt and an answer"
    )
    starts = np.cumsum(lengths) - lengths
    other = (np.arange(n) + 1) % n
    kl_lens = np.minimum(prompt + lengths[other] - prompt[other], cutoff_len)
    # two ranges per KL sequence: the prompt of sample i, then the answer of sample j
    range_starts = np.stack([starts, starts[other] + prompt[other]], axis=1).ravel()
    range_lens = np.stack([prompt, kl_lens - prompt], axis=1).ravel()
    source = gather_ranges(range_starts, range_lens)
    kl_ids = ids[source]
    # a token is trained when it belongs to the answer and was trained in sample j, i.e. the
    # target before it (in sample j; prompt_len >= 1) is not ignored
    in_answer = np.repeat(np.tile([False, True], n), range_lens)
    trained = in_answer & (targets[np.maximum(source - 1, 0)] != IGNORE_INDEX)
    kl_targets = np.where(np.roll(trained, -1), np.roll(kl_ids, -1), IGNORE_INDEX)
    kl_targets[np.cumsum(kl_lens) - 1] = IGNORE_INDEX  # no sequence predicts the next one
    offsets = pa.array(np.concatenate([[0], np.cumsum(kl_lens)]).astype(np.int32))

    def as_list(values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(offsets, pa.array(values.astype(np.int32)))

    samples = samples.append_column("kl_input_ids", as_list(kl_ids))
    samples = samples.append_column("kl_targets", as_list(kl_targets))
    if "rope_positions" in samples.column_names:
        rope = _kl_rope_positions(samples.column("rope_positions"), starts, prompt, kl_lens)
        rope_offsets = pa.array(np.concatenate([[0], np.cumsum(3 * kl_lens)]).astype(np.int32))
        kl_rope = pa.ListArray.from_arrays(rope_offsets, pa.array(rope.astype(np.int32)))
        samples = samples.append_column("kl_rope_positions", kl_rope)
    return samples


def _kl_rope_positions(
    column: pa.ChunkedArray, starts: np.ndarray, prompt: np.ndarray, kl_lens: np.ndarray
) -> np.ndarray:
    """The 3-D rotary positions (M-RoPE: 3 per token, token after token) of the KL
    sequences: sample i's own for its prompt (its images' included), then for the other
    sample's answer text positions counting on from the prompt's largest, equal in all
    three, as the family's positions for text after images are."""
    rope = pc.list_flatten(column).to_numpy().astype(np.int64)
    prompt_values = rope[gather_ranges(3 * starts, 3 * prompt)]
    prompt_offsets = np.cumsum(3 * prompt) - 3 * prompt
    following = np.maximum.reduceat(prompt_values, prompt_offsets) + 1  # per sequence
    answer = kl_lens - prompt
    within = np.arange(answer.sum()) - np.repeat(np.cumsum(answer) - answer, answer)
    answer_values = np.repeat(np.repeat(following, answer) + within, 3)
    # each KL sequence: its prompt's values, then its answer's
    joined = np.concatenate([prompt_values, answer_values])
    answer_offsets = len(prompt_values) + np.cumsum(3 * answer) - 3 * answer
    range_starts = np.stack([prompt_offsets, answer_offsets], axis=1).ravel()
    range_lens = np.stack([3 * prompt, 3 * answer], axis=1).ravel()
    return joined[gather_ranges(range_starts, range_lens)]
