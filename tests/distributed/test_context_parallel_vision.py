"""Context parallelism for vision-language models: a row with images, split over a group of
2 processes, computes what one process computes on the whole row.

Each process embeds the whole row (its images' features merged in) and its language model
takes its part of the embeddings (keel.models.attention.embed_whole_row). Two levels: the
objective's loss, logits and gradients on one row whose cut falls inside an image's tokens,
for every family whose attention is causal (Qwen2-VL's, Qwen2.5-VL's and GLM-4V's 3-D
positions, Qwen3-VL's features added in the first layers, LLaVA-NeXT's tiles, Idefics3's
crops); and whole `keel train` runs on a tiny Qwen2-VL, a group of 2 against one process.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
import vlm_support as vs
import vlm_support_more as vsm
import yaml
from multiproc import Workspace, free_port, single_process_runs
from test_context_parallel import CASES as TEXT_CASES
from test_context_parallel import CP2, assert_same_run, one_group

from keel.distributed.context_parallel import shard_tokens
from keel.distributed.process_group import exit_now, shutdown

# family -> (tokenizer, model, image processor) builders
FAMILIES = {
    "qwen2_vl": (
        vs.build_qwen2_vl_tokenizer,
        vs.build_tiny_qwen2_vl,
        vs.build_qwen2_vl_image_processor,
    ),
    "qwen2_5_vl": (
        vs.build_qwen2_vl_tokenizer,
        vs.build_tiny_qwen2_5_vl,
        vs.build_qwen2_vl_image_processor,
    ),
    "qwen3_vl": (
        vs.build_qwen2_vl_tokenizer,
        vs.build_tiny_qwen3_vl,
        vs.build_qwen2_vl_image_processor,
    ),
    "glm4v": (vsm.build_glm4v_tokenizer, vsm.build_tiny_glm4v, vsm.build_glm4v_image_processor),
    "llava": (vs.build_llava_tokenizer, vs.build_tiny_llava, vs.build_llava_image_processor),
    "llava_next": (
        vs.build_llava_tokenizer,
        vs.build_tiny_llava_next,
        vs.build_llava_next_image_processor,
    ),
    "idefics3": (
        vsm.build_idefics3_tokenizer,
        vsm.build_tiny_idefics3,
        vsm.build_idefics3_image_processor,
    ),
}
TOL = 1e-5


def _row(name: str, cut_parts: int = 2):
    """(model, family, batch): a padding-free row of two samples with three images, the
    second sample's text lengthened after its images until the cut into `cut_parts` falls
    inside an image's tokens; targets on every text token."""
    from keel.models.vision import family_of

    make_tokenizer, make_model, make_processor = FAMILIES[name]
    tokenizer = make_tokenizer()
    model = make_model(tokenizer).float()
    family = family_of(model.config)
    images = [vs.make_image(0, (80, 100)), vs.make_image(1, (60, 30)), vs.make_image(2)]
    prepared = family.prepare_images(make_processor(), images, model.config)
    image_id = tokenizer.convert_tokens_to_ids(family.image_token)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first = ids(f"look {prepared[0].text} what? red")
    for filler in range(64):  # each token of filler moves the cut half a token on
        second = ids(f"hi {prepared[1].text} and {prepared[2].text} ok{' x' * filler}")
        row = first + second
        cut = -(-len(row) // cut_parts)
        if row[cut - 1] == image_id and row[cut] == image_id:  # an image split in two
            break
    else:
        raise AssertionError(f"{name}: no filler puts the cut inside an image")
    samples = [(first, prepared[:1]), (second, prepared[1:])]
    return model, family, _batch(model, family, samples, image_id)


def _batch(model, family, samples, image_id: int) -> dict:
    ids = [i for sample, _ in samples for i in sample]
    targets = []
    for sample, _ in samples:  # pre-shifted: each token's next, none across samples
        targets += [t if t != image_id else -100 for t in sample[1:]] + [-100]
    batch = {
        "input_ids": torch.tensor([ids]),
        "targets": torch.tensor([targets]),
        "position_ids": torch.cat([torch.arange(len(s)) for s, _ in samples])[None],
        "seq_lens": tuple(len(s) for s, _ in samples),
        "images": [p.tensors for _, images in samples for p in images],
    }
    if family.rope == "mrope":
        rope = [
            family.rope_positions(s, [p.tensors for p in im], model.config) for s, im in samples
        ]
        batch["rope_position_ids"] = torch.cat(rope, dim=1)[:, None]  # [3, 1, T]
    return batch


def _objective(model, family):
    from keel.models.attention import VARLEN_ATTENTION, register_varlen_attention
    from keel.train.objective import CausalLMObjective, use_attention

    register_varlen_attention()
    use_attention(model, VARLEN_ATTENTION)
    return CausalLMObjective(model, chunk_size=5, vision=family)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    ctx = one_group(rank, world, port)
    group, seen = ctx.cp_group, {}
    for name in FAMILIES:
        model, family, batch = _row(name)
        objective = _objective(model, family)
        part = shard_tokens(batch, rank, world, pad_id=0, whole_inputs=True)
        part["cp_group"] = group
        for fast_head in (False, True):
            objective.fast_head = fast_head
            want_loss, want_grads = _loss_and_grads(objective, batch, None)
            loss, grads = _loss_and_grads(objective, part, group)
            seen[f"{name}-{fast_head}-loss"] = abs(loss - want_loss) / abs(want_loss)
            seen[f"{name}-{fast_head}-grads"] = _grad_error(grads, want_grads)
        with torch.no_grad():
            whole = model(**objective.inputs(batch)).logits
            mine = model(**objective.inputs(part)).logits
        span = mine.shape[1]
        real = min(span, whole.shape[1] - rank * span)
        seen[f"{name}-logits"] = (
            (mine[0, :real] - whole[0, rank * span : rank * span + real]).abs().max().item()
        )
        seen[f"{name}-probe"] = objective.check_context_parallel(group, rank, world)
        try:  # negative control: the ids cut as for a text model
            objective(shard_tokens(batch, rank, world, pad_id=0) | {"cp_group": group})
            seen[f"{name}-ids-cut"] = "ran"
        except (ValueError, RuntimeError) as error:
            seen[f"{name}-ids-cut"] = str(error)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    shutdown(ctx)
    exit_now(0)


def _grad_error(got: dict, want: dict) -> tuple[float, str]:
    """(largest relative difference, its parameter) over the parameters whose gradient is
    not round-off (a key bias's is zero in exact arithmetic: softmax ignores it)."""
    assert got.keys() == want.keys()
    scale = max(w.abs().max().item() for w in want.values())
    return max(
        ((got[n] - w).abs().max().item() / w.abs().max().item(), n)
        for n, w in want.items()
        if w.abs().max() > 1e-4 * scale
    )


def _loss_and_grads(objective, batch: dict, group) -> tuple[float, dict]:
    """The loss sum and every parameter's gradient; with `group`, summed over it."""
    objective.zero_grad()
    loss = objective(batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    loss = loss.detach().clone()
    if group is not None:
        torch.distributed.all_reduce(loss, group=group)
        for grad in grads.values():
            torch.distributed.all_reduce(grad, group=group)
    return loss.item(), grads


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("cp_vision") / "seen")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2)
    return [json.loads(open(f"{out}.{rank}").read()) for rank in range(2)]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_row_with_an_image_cut_in_two_gives_the_whole_rows_loss_and_gradients(seen, name):
    for rank in range(2):
        for fast_head in (False, True):
            assert seen[rank][f"{name}-{fast_head}-loss"] < TOL
            error, parameter = seen[rank][f"{name}-{fast_head}-grads"]
            assert error < TOL, parameter
        assert seen[rank][f"{name}-logits"] < TOL
        ok, why = seen[rank][f"{name}-probe"]
        assert ok, why
        # what a text model's cut would do: each part holds some of an image's tokens and
        # all its features
        assert "Image features and image tokens do not match" in seen[rank][f"{name}-ids-cut"]


def test_a_vision_models_parts_keep_the_whole_rows_ids_and_positions():
    _, _, batch = _row("qwen2_vl")
    tokens = batch["input_ids"].shape[1]
    assert tokens % 2  # odd: the parts add a pad token
    parts = [shard_tokens(batch, rank, 2, pad_id=0, whole_inputs=True) for rank in range(2)]
    for part in parts:
        assert torch.equal(part["input_ids"][:, :tokens], batch["input_ids"])
        assert part["input_ids"][0, tokens] == 0 and part["seq_lens"][-1] == 1
        assert torch.equal(part["rope_position_ids"][..., :tokens], batch["rope_position_ids"])
        assert part["rope_position_ids"][:, 0, tokens].tolist() == [0, 0, 0]  # a new sample
        assert torch.equal(part["position_ids"][:, :tokens], batch["position_ids"])
        assert part["images"] is batch["images"]
    targets = torch.cat([part["targets"] for part in parts], dim=1)  # cut
    assert torch.equal(targets[:, :tokens], batch["targets"]) and targets[0, tokens] == -100


# ---- whole runs: a group of 2 against one process, a tiny Qwen2-VL ---------------------

CASES = {
    # LoRA on the language model, the tower frozen
    "cp2-ddp-lora": ("method.type=lora", "distributed.strategy=ddp"),
    # packed rows (each sample's images and 3-D positions with it), checkpointed layers
    "cp2-fsdp-lora-packed-ckpt": TEXT_CASES["cp2-fsdp-lora-packed-ckpt"],
    # everything trains, the tower and projector too (kept whole on every process)
    "cp2-fsdp-full-tower": (
        "method.type=full",
        "model.vision.freeze_tower=false",
        "model.vision.freeze_projector=false",
        "distributed.strategy=fsdp",
    ),
    # pairs whose prompt holds an image: each process scores its part of both sequences
    "cp2-ddp-dpo": (
        "train.stage=dpo",
        "data.datasets=[pairs/pairs.json]",  # beside the config
        "train.global_batch_size=4",
        "distributed.strategy=ddp",
    ),
    # KTO samples whose prompt holds an image: each process scores its part of a sample and
    # of its KL sequence (the prompt's images, positions of its own), the KL estimate summed
    "cp2-fsdp-kto": (
        "train.stage=kto",
        "data.datasets=[pairs/kto.json]",
        "train.global_batch_size=4",
        "distributed.strategy=fsdp",
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("cp_vision_runs")
    workspace = Workspace(root, vs.write_tiny_qwen2_vl_dir(root / "qwen2_vl"))
    config = yaml.safe_load(workspace.config.read_text())
    config["data"]["datasets"] = [str(vs.write_colour_dataset(root / "colours"))]
    workspace.config.write_text(yaml.safe_dump(config))
    _write_pairs(root / "pairs")
    return workspace


def _write_pairs(folder) -> None:
    """pairs.json in `folder`: six DPO pairs asking an image's colour (LLaMA-Factory's
    prompt / chosen / rejected + images form), and kto.json: their answers as KTO samples."""
    rows = []
    answers = (("red", "blue"), ("green", "red"), ("blue", "green")) * 2
    for index, (name, wrong) in enumerate(answers):
        rgb = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}[name]
        image = vs.write_image(folder / f"pair{index}.png", seed=index, colour=rgb)
        rows.append(
            {
                "prompt": [{"role": "user", "content": "<image>What colour is this?"}],
                "chosen": [{"role": "assistant", "content": f"It is {name}."}],
                "rejected": [{"role": "assistant", "content": f"It is {wrong} or so."}],
                "images": [str(image)],
            }
        )
    (folder / "pairs.json").write_text(json.dumps(rows))
    samples = [  # the same prompts as KTO samples: each answer labelled on its own
        {**{k: row[k] for k in ("prompt", "images")}, "completion": row[key], "label": good}
        for row in rows
        for key, good in (("chosen", True), ("rejected", False))
    ]
    (folder / "kto.json").write_text(json.dumps(samples))


@pytest.fixture(scope="module")
def reference(workspace):
    return single_process_runs(workspace)


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict:
    return workspace.train_together([(name, (*CP2, *extra)) for name, extra in CASES.items()])


@pytest.mark.parametrize("case", CASES)
def test_two_processes_splitting_rows_with_images_match_one(
    workspace, reference, two_processes, case
):
    got = two_processes[case]
    want = reference(*CASES[case][:-1])  # one process, no strategy
    assert "1 group(s) of 2 processes (context parallel)" in workspace.outputs_together[case]
    assert_same_run(got, want)
