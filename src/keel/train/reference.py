"""The reference model of DPO and KTO: a frozen copy, or log-probs computed once and cached.

With LoRA the reference is the policy with its adapters switched off (keel.train.preference);
nothing here is needed. With full or freeze fine-tuning it is either

- live: a second, frozen copy of the base, built like the policy (meta device, then under
  FSDP sharded into its own units, then each rank loads its shards), or
- precompute: one pass over every train and eval row before training, split across ranks,
  with the policy itself (it still holds the base weights then). Each rank writes its rows'
  log-probs to a cache folder keyed by a fingerprint of the data (which covers the template
  and cutoff), the model and the precision; rank 0 marks it complete; every rank reads all
  of it. A resumed run finds the cache and skips the pass. Under FSDP every rank runs the
  same number of forwards (filler micro-batches), so the pass cannot hang on uneven shares.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from keel.distributed.parallelize import (
    ParallelizeSettings,
    fsdp_units,
    local_region,
    local_tensor,
    parallelize,
    unwrap,
)
from keel.distributed.process_group import DistContext
from keel.distributed.strategy import Strategy
from keel.models import torch_dtype
from keel.models.materialize import (
    Starts,
    allocate,
    build_empty_model,
    fill_weights,
    init_computed_buffers,
)
from keel.models.tensor_plan import required_tensor_plan
from keel.models.trainable import decoder_layers
from keel.models.vision import family_of
from keel.models.vocabulary import configured_tokens, grow_vocabulary
from keel.precision import Precision
from keel.train.batch_source import split_for_rank
from keel.train.loop import Trainer
from keel.train.objective import causal_lm_of, vision_modules
from keel.train.preference import SequenceScorer

if TYPE_CHECKING:
    from keel.config import RunConfig
    from keel.data import PreparedData

COMPLETE = "complete.json"


def build_reference_copy(
    cfg, model_dir: Path, dist: DistContext, precision: Precision, *, sharded: bool, fast_head: bool
) -> SequenceScorer:
    """A frozen copy of the base model as a `SequenceScorer`, placed like the policy: under
    FSDP (`sharded`) each decoder layer and the scorer are their own units, so a rank holds
    and loads only its shards of the copy too."""
    dtype = torch_dtype(cfg.model.dtype) or torch.float32  # as the policy's weights
    model = build_empty_model(
        model_dir,
        dtype=dtype,
        attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    added = configured_tokens(model_dir, cfg.model)  # rows as the policy's
    grow_vocabulary(model, added, log=lambda _message: None)
    model.requires_grad_(False)
    lm = causal_lm_of(model)
    vision = family_of(lm.config)
    scorer = SequenceScorer(
        model, chunk_size=cfg.train.loss_chunk_size, fast_head=fast_head, vision=vision
    )
    if sharded:
        # Its own layout: no gradients to reduce, no offload, and the embeddings stay in the
        # root unit (the policy makes untied ones a unit of their own); split as the policy.
        tensor = required_tensor_plan(lm, dist.tp_size) if dist.tp_size > 1 else None
        frozen = ParallelizeSettings(
            strategy=Strategy.FSDP,
            units=fsdp_units(lm, decoder_layers(lm), embeddings=False),
            replicated=vision_modules(lm, vision),
            reshard_after_forward=True,
            param_dtype=precision.autocast_dtype,
            tensor=tensor,
        )
        parallelize(scorer, dist.dims.with_strategy(Strategy.FSDP), frozen)
    allocate(scorer, dist.device)
    init_computed_buffers(causal_lm_of(model), dist.device)
    starts = Starts(seed=cfg.train.seed, added=added)
    fill_weights(model, model_dir, starts, region_of=local_region, local=local_tensor)
    return scorer.eval()


@dataclass
class ReferenceLogps:
    """Precomputed reference log-probs of one split, by row: what `collate` adds to a batch."""

    main: dict[int, list[float]]
    kl: dict[int, list[float]]

    def row(self, index: int) -> dict[str, list[float]]:
        out = {"reference_logps": self.main[index]}
        if self.kl:
            out["reference_kl_logps"] = self.kl[index]
        return out


def reference_fingerprint(data_fingerprint: str, model_dir: Path, precision: Precision) -> str:
    """What the cached log-probs depend on: the prepared rows (data, template, cutoff, stage,
    packing), the base model's files and the compute precision."""
    files = []
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix in (".json", ".safetensors", ".bin") and path.is_file():
            stat = path.stat()
            files.append([path.name, stat.st_size, stat.st_mtime_ns])
    blob = json.dumps(
        {
            "data": data_fingerprint,
            "model": str(Path(model_dir).resolve()),
            "files": files,
            "precision": precision.name,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass
class PrecomputeJob:
    """One precompute pass: where the cache goes and the rows it covers."""

    folder: Path  # <cache>/reference/<fingerprint>
    splits: dict[str, list[dict]]  # "train" / "eval" -> rows
    micro_batch_size: int

    @classmethod
    def of(
        cls, cfg: RunConfig, data: PreparedData, model_dir: Path, precision: Precision
    ) -> PrecomputeJob:
        """The pass a run needs: every row of its train (and eval) split, cached under
        model.cache_dir by what the log-probs depend on (`reference_fingerprint`)."""
        splits = {"train": data.train}
        if data.eval is not None:
            splits["eval"] = data.eval
        key = reference_fingerprint(data.fingerprint, model_dir, precision)
        return cls(
            folder=Path(cfg.model.cache_dir).expanduser() / "reference" / key,
            splits={name: [split[i] for i in range(len(split))] for name, split in splits.items()},
            micro_batch_size=cfg.train.micro_batch_size,
        )


def precompute_reference(
    trainer: Trainer, job: PrecomputeJob, dist: DistContext, log: Callable[[str], None]
) -> dict[str, ReferenceLogps]:
    """Reference log-probs of every row of every split, from the cache or computed now."""
    marker = job.folder / COMPLETE
    if not marker.is_file():
        _compute(trainer, job, dist, log)
    else:
        log(f"reference log-probs: loaded from cache {job.folder}")
    listed = json.loads(marker.read_text(encoding="utf-8"))["files"]
    found: dict[str, ReferenceLogps] = {name: ReferenceLogps({}, {}) for name in job.splits}
    for name in listed:
        tensors = load_file(job.folder / name)
        split = name.split(".")[0]
        _unpack(tensors, found[split])
    for split, rows in job.splits.items():
        missing = len(rows) - len(found[split].main)
        if missing:
            raise RuntimeError(
                f"reference cache {job.folder} lacks {missing} {split} row(s); delete it "
                f"and run again"
            )
    return found


def _compute(trainer: Trainer, job: PrecomputeJob, dist: DistContext, log) -> None:
    log(
        f"reference log-probs: one pass over "
        f"{', '.join(f'{len(r)} {s}' for s, r in job.splits.items())} rows before training "
        f"(cached at {job.folder})"
    )
    if dist.is_main:
        shutil.rmtree(job.folder, ignore_errors=True)
        job.folder.mkdir(parents=True)
    dist.barrier()
    objective = trainer.objective
    objective.eval()
    files = []
    for split, rows in job.splits.items():
        indices = list(range(len(rows)))
        mine = split_for_rank(indices, dist.dp_rank, dist.dp_size, job.micro_batch_size)
        main_parts, kl_parts, done = [], [], []
        for index, chunk in enumerate(mine):
            trainer.progress.mark(("reference pass", split, index))
            batch_rows = [rows[i] for i in chunk] or rows[:1]  # filler: same forwards on all ranks
            with torch.no_grad(), trainer.precision.autocast(trainer.device):
                main, kl = objective(trainer._batch(batch_rows), mode="reference")
            if chunk:
                main_parts.append(main.float().cpu())
                kl_parts.append(kl.float().cpu() if kl is not None else torch.zeros(0))
                done += chunk
        if dist.leads_group:  # a context- or tensor-parallel group holds the same values
            name = f"{split}.rank-{dist.dp_rank:05d}-of-{dist.dp_size:05d}.safetensors"
            files.append(name)
            _save(job.folder / name, rows, done, main_parts, kl_parts)
    names = dist.gather_objects(files)
    dist.barrier()
    if dist.is_main:
        listed = sorted(n for rank_files in names for n in rank_files)
        tmp = job.folder / f".{COMPLETE}.tmp"
        tmp.write_text(json.dumps({"files": listed}), encoding="utf-8")
        os.replace(tmp, job.folder / COMPLETE)
    dist.barrier()
    unwrap(objective).train()


def _save(path: Path, rows: list[dict], done: list[int], main_parts, kl_parts) -> None:
    """Row indices, each row's sequence count, and the flat values (safetensors: no pickle)."""
    per_row = [len(rows[i]["labels"]) for i in done]
    tensors = {
        "rows": torch.tensor(done, dtype=torch.int64),
        "sequences": torch.tensor(per_row, dtype=torch.int64),
        "main": torch.cat(main_parts) if main_parts else torch.zeros(0),
        "kl": torch.cat(kl_parts) if kl_parts else torch.zeros(0),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def _unpack(tensors: dict[str, torch.Tensor], into: ReferenceLogps) -> None:
    main, kl = tensors["main"].tolist(), tensors["kl"].tolist()
    at = 0
    for row, count in zip(tensors["rows"].tolist(), tensors["sequences"].tolist()):
        into.main[row] = main[at : at + count]
        if kl:
            into.kl[row] = kl[at : at + count]
        at += count
