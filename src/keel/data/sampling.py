"""Which rows of a source are used: its split, `num_samples`, `max_samples`.

They apply in LLaMA-Factory's order (loader.py `_load_single_dataset`): the split when the
data is loaded, then `num_samples`, then `max_samples` (the first N rows of what is left).

- split: a split name, optionally sliced with the `datasets` syntax (`train[:1000]`,
  `train[10%:]`, `train[:10%]+train[-5:]`), which is what LLaMA-Factory hands to
  `load_dataset`. A local file, or a folder of files, has one split: `train`.
- num_samples: LLaMA-Factory's sampling with numpy: the first N of a random permutation of
  the rows; when N exceeds the rows, every row once and the rest drawn with replacement.
  LLaMA-Factory draws from numpy's global generator, which `transformers.set_seed` seeds
  with the run's seed before the datasets load; keel draws from a generator seeded the same
  way, shared by the sources in their order, so the same seed picks the same rows.
"""

from __future__ import annotations

import numpy as np

from keel.errors import DataError

FILE_SPLITS = ("train",)  # the split names of a local file or folder


def split_ranges(
    spec: str, sizes: dict[str, int], where: str, why: str = ""
) -> list[tuple[str, int, int]]:
    """[(split name, start, stop)] that `spec` selects, given each split's number of rows."""
    from datasets import ReadInstruction

    try:
        instructions = ReadInstruction.from_spec(spec).to_absolute(sizes)
    except (ValueError, AssertionError) as e:
        first = next(iter(sizes))
        raise DataError(
            f"{where}: split '{spec}' cannot be used: {e} {why}Use one of {', '.join(sizes)}, "
            f"optionally sliced as in {first}[:1000] or {first}[:10%]"
        ) from None
    return [(i.splitname, i.from_, i.to) for i in instructions]


def check_split(spec: str, names: tuple[str, ...], where: str, why: str = "") -> None:
    """Refuse a split `spec` that names a split not in `names` or is not valid syntax."""
    if spec not in names:
        split_ranges(spec, dict.fromkeys(names, 0), where, why)


def split_indices(spec: str, rows: int, where: str) -> np.ndarray:
    """Row positions that `spec` selects from a source with one split, `train`, of `rows`."""
    ranges = split_ranges(spec, {"train": rows}, where)
    return np.concatenate([np.arange(start, stop) for _, start, stop in ranges])


def sample_indices(rows: int, num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """LLaMA-Factory's `num_samples`: a permutation's first N rows, then draws with replacement.

    The two numpy calls are LLaMA-Factory's (permutation, then choice only when more rows
    are asked for than there are), so the same generator state picks the same rows.
    """
    if rows == 0:
        return np.arange(0)
    indices = rng.permutation(rows)[:num_samples]
    missing = num_samples - len(indices)
    if missing > 0:
        indices = np.concatenate((indices, rng.choice(rows, missing)), axis=0)
    return indices
