"""One process of a vision-language training run with a rank that sees no image.

torchrun --nproc-per-node N vision_worker.py OUT CASE:STRATEGY... (N = 1: the reference).

Three optimizer steps of a tiny Qwen2-VL through keel's own set-up pieces (parallelize with
the tower and projector replicated, CausalLMObjective with the family, Trainer.train_step
with its replicated-gradient sync and clipping). The global batch of each step is four
micro-batches: two with an image (rank 0's under 2 processes) and two text-only (rank 1's);
the last step is text-only on every rank (no rank runs the tower: its parameters must keep no
gradient, as in one process, so AdamW skips them rather than stepping on old moments).
Rank 0 writes {"losses", "grad_norms", "weights"} to OUT/CASE-STRATEGY-N.pt.

CASE: frozen-lora (LoRA on the language model, tower frozen), frozen-full (language model
fully trained, tower frozen), trainable-full (everything trains), unsynced (everything
trains, the tower kept out of DDP/FSDP but its gradients never averaged: the negative
control, whose tower ends up different on each rank).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlm_support import (  # noqa: E402
    build_qwen2_vl_image_processor,
    build_qwen2_vl_tokenizer,
    build_tiny_qwen2_vl,
)

from keel.distributed.parallel_dims import ParallelDims  # noqa: E402
from keel.distributed.parallelize import (  # noqa: E402
    ParallelizeSettings,
    fsdp_units,
    parallelize,
    replicated_parameters,
)
from keel.distributed.process_group import DistContext, exit_now  # noqa: E402
from keel.distributed.strategy import Strategy  # noqa: E402
from keel.models.trainable import decoder_layers  # noqa: E402
from keel.models.vision import blobs, family_of  # noqa: E402
from keel.precision import resolve_precision  # noqa: E402
from keel.train.loop import Trainer  # noqa: E402
from keel.train.objective import CausalLMObjective, causal_lm_of, vision_modules  # noqa: E402

STEPS = 2  # with images on rank 0; then one more step, text-only on every rank
MICRO_BATCHES = 4  # per step, over all processes: images first, then text only


def make_rows(family, tokenizer, model_config) -> list[dict]:
    """MICRO_BATCHES encoded rows (the data -> train contract's columns): image rows, then
    text-only rows, with different lengths so padding and position rows matter."""
    from PIL import Image

    processor = build_qwen2_vl_image_processor()
    rows = []
    for index in range(MICRO_BATCHES):
        prompt = tokenizer(f"user: question {index} about", add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" answer {'x' * index}<|im_end|>", add_special_tokens=False)
        images = []
        if index < MICRO_BATCHES // 2:
            pixels = torch.randint(0, 255, (70 + 14 * index, 84, 3), dtype=torch.uint8)
            (image,) = family.prepare_images(
                processor, [Image.fromarray(pixels.numpy())], model_config
            )
            prompt += tokenizer(image.text, add_special_tokens=False)["input_ids"]
            images = [image.tensors]
        ids = prompt + answer["input_ids"]
        targets = [-100] * len(prompt) + answer["input_ids"]
        rope = family.rope_positions(ids, images, model_config)  # [3, T]
        rows.append(
            {
                "input_ids": ids,
                "targets": targets[1:] + [-100],
                "position_ids": list(range(len(ids))),
                "image_blobs": [blobs.pack(t) for t in images],
                "rope_positions": rope.T.reshape(-1).tolist(),
            }
        )
    return rows


def build(case: str, strategy: Strategy, dist: DistContext):
    tokenizer = build_qwen2_vl_tokenizer()
    model = build_tiny_qwen2_vl(tokenizer, seed=0)
    family = family_of(model.config)
    if case == "frozen-lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora)
        lm = model.get_base_model()
    else:
        lm = model
        if case == "frozen-full":
            lm.model.visual.requires_grad_(False)
    towers = vision_modules(lm, family)
    objective = CausalLMObjective(model, chunk_size=16, vision=family)
    settings = ParallelizeSettings(
        strategy=strategy,
        units=fsdp_units(lm, decoder_layers(lm), embeddings=True) if strategy.shards else (),
        replicated=towers,
    )
    wrapped = parallelize(objective, dist.dims, settings)
    ok, why = objective.check_fast_head()
    assert ok, why
    objective.fast_head = True
    replicated = [p for p in replicated_parameters(settings) if p.requires_grad]
    return tokenizer, wrapped, replicated


def run_case(case: str, strategy: Strategy, dist: DistContext) -> dict:
    """STEPS optimizer steps of `case`: {"losses", "grad_norms", "weights"} (rank 0's)."""
    tokenizer, objective, replicated = build(case, strategy, dist)
    trainable = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    trainer = Trainer(
        objective=objective,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        precision=resolve_precision("fp32", torch.device("cpu")),
        device=torch.device("cpu"),
        pad_id=tokenizer.pad_token_id,
        max_grad_norm=1.0,
        dist=dist,
        strategy=strategy,
        # "unsynced": the tower kept out of DDP/FSDP but its gradients never averaged
        replicated=[] if case == "unsynced" else replicated,
    )
    inner = trainer.inner_objective
    rows = make_rows(inner.vision, tokenizer, causal_lm_of(inner.model).config)
    per_rank = MICRO_BATCHES // dist.world_size
    mine = [[row] for row in rows[dist.rank * per_rank : (dist.rank + 1) * per_rank]]
    targets = sum(sum(t != -100 for t in row["targets"]) for row in rows)
    results = [
        trainer.train_step(mine, window_targets=targets, window_tokens=0, filler=rows[0])
        for _ in range(STEPS)
    ]
    text_rows = rows[MICRO_BATCHES // 2 :]  # each rank's share of the text-only step
    share = len(text_rows) // dist.world_size
    text_only = [[row] for row in text_rows[dist.rank * share : (dist.rank + 1) * share]]
    text_targets = sum(sum(t != -100 for t in row["targets"]) for row in text_rows)
    results.append(
        trainer.train_step(text_only, window_targets=text_targets, window_tokens=0, filler=rows[0])
    )
    reduced = trainer.reduce_losses(results)
    weights = {
        name.replace("_fsdp_wrapped_module.", ""): value.full_tensor()
        if hasattr(value, "full_tensor")
        else value.detach().clone()
        for name, value in inner.model.state_dict().items()
    }
    return {"losses": reduced.losses, "grad_norms": reduced.grad_norms, "weights": weights}


def main(out: Path, specs: list[str]) -> None:
    """Each spec is CASE:STRATEGY; one process group for all of them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    mesh = ParallelDims.for_strategy(Strategy.SINGLE, world)
    if world > 1:
        torch_dist.init_process_group("gloo")
        mesh = mesh.build_mesh("cpu")
    for spec in specs:
        case, name = spec.split(":")
        strategy = Strategy(name) if world > 1 else Strategy.SINGLE
        dist = DistContext(rank=rank, world_size=world, dims=mesh.with_strategy(strategy))
        found = run_case(case, strategy, dist)
        if rank == 0:
            torch.save(found, out / f"{case}-{name}-{world}.pt")
    if world > 1:
        torch_dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2:])
    exit_now(0)  # FSDP2's cached DeviceMesh keeps gloo's threads alive past here
