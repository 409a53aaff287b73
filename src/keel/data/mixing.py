"""How the training datasets are read and mixed (data.mix), as LLaMA-Factory mixes them.

`concat` (the default) keeps every row of every dataset; the run's shuffle then mixes
them. The `interleave_*` mixes draw rows from the datasets in turn, or by `data.mix_weights`,
as LLaMA-Factory's `mix_strategy` does with `datasets.interleave_datasets`: `interleave_under`
until the first dataset runs out, `interleave_over` until each has run out (the others drawn
again), `interleave_once` until each has run out with no row drawn twice. The draws are
`interleave_datasets`'s own over the rows' positions, with the run's seed, so the same seed
picks the same rows as LLaMA-Factory. They apply to each dataset's rows after its split,
`num_samples` and `max_samples`, before anything is tokenized (as LLaMA-Factory merges
before it preprocesses); data.eval_datasets are mixed alike.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from keel.config.schema import DataConfig
from keel.data.sources import Source, SourceUnit, load_source, select_rows
from keel.errors import DataError

# data.mix -> interleave_datasets' stopping_strategy
STOPPING = {
    "interleave_under": "first_exhausted",
    "interleave_over": "all_exhausted",
    "interleave_once": "all_exhausted_without_replacement",
}


def mixes(mix: str, datasets: int) -> bool:
    """Whether data.mix draws from the datasets: an interleave mix, and more than one."""
    return mix != "concat" and datasets > 1


def source_loader(
    cfg: DataConfig, *, cache_dir: Path, base_dir: Path, seed: int, log: Callable[[str], None]
) -> Callable[[list[Source]], list[list[SourceUnit]]]:
    """load(sources) -> each source's rows as units, mixed by data.mix. One generator draws
    `num_samples` for every source, in order (LLaMA-Factory draws from numpy's global
    generator, seeded with the run's seed, dataset after dataset)."""
    one = partial(
        load_source,
        cache_dir=cache_dir,
        base_dir=base_dir,
        rng=np.random.RandomState(seed),
        log=log,
        max_row_bytes=cfg.max_row_bytes,
    )

    def load(sources: list[Source]) -> list[list[SourceUnit]]:
        loaded = [one(src) for src in sources]
        if not mixes(cfg.mix, len(loaded)):
            return loaded
        return mixed(loaded, sources, cfg, seed, log)

    return load


def mixed(
    loaded: list[list[SourceUnit]],
    sources: list[Source],
    cfg: DataConfig,
    seed: int,
    log: Callable[[str], None],
) -> list[list[SourceUnit]]:
    """Each source's rows that `interleave_datasets` draws (repeats allowed), in draw order."""
    from datasets import Dataset, interleave_datasets

    sizes = [sum(len(u.dataset) for u in units if u.dataset is not None) for units in loaded]
    for src, size in zip(sources, sizes, strict=True):
        if not size:
            raise DataError(
                f"{src.where}: no rows to mix (data.mix {cfg.mix} draws from every dataset); "
                f"remove the entry or use data.mix concat"
            )
    positions = [
        Dataset.from_dict({"source": np.full(n, k), "row": np.arange(n)})
        for k, n in enumerate(sizes)
    ]
    drawn = interleave_datasets(
        positions,
        probabilities=cfg.mix_weights or None,
        seed=seed,
        stopping_strategy=STOPPING[cfg.mix],
    ).with_format("numpy")[:]  # through its indices mapping: the rows drawn, in order
    source, row = drawn["source"], drawn["row"]
    out = []
    for k, units in enumerate(loaded):
        chosen = row[source == k]
        out.append(select_rows(units, chosen))
        repeats = len(chosen) - len(np.unique(chosen))
        again = f", {repeats} drawn again" if repeats else ""
        log(
            f"data: {sources[k].label}: {len(chosen)} of {sizes[k]} rows{again} (data.mix {cfg.mix})"
        )
    return out
