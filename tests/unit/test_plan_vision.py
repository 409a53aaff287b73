"""`keel plan` for vision-language models: the tower counted and replicated, image tokens'
activations, and field note 2's question (Qwen2-VL-72B on 8 x 24 GiB) answered."""

import json
import re
from pathlib import Path

import pytest
import yaml
from vlm_support import (
    build_llava_tokenizer,
    build_qwen2_vl_tokenizer,
    llava_config,
    qwen2_vl_config,
)

from keel.config import load_config
from keel.plan import DeviceSpec, detect_devices, plan_run, summary, to_json
from keel.plan.census import REPLICATED
from keel.plan.devices import GIB
from keel.plan.estimate import state_bytes
from keel.plan.vision import LANGUAGE, PROJECTOR, TOWER, image_budget
from keel.precision import Precision

# Qwen2-VL-72B(-Instruct)'s config.json as published: the Qwen2-72B language model, a
# 32-block ViT of width 1280 and the patch merger into the LM's 8192. No weights anywhere.
QWEN2_VL_72B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 29568,
    "max_position_embeddings": 32768,
    "max_window_layers": 80,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 8192,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}
TOWER_72B = 631_183_360  # patch embedding + 32 ViT blocks
PROJECTOR_72B = 68_173_312  # the patch merger (LayerNorm, 5120 -> 5120 -> 8192)
LANGUAGE_72B = 72_706_203_648  # exactly Qwen2-72B's (tests/unit/test_plan.py)
FP32 = Precision("fp32", "test")
ROOT = Path(__file__).resolve().parents[2]
DOCS_PAGE = ROOT / "docs" / "distributed.md"
# docs/distributed.md's command for this model, its model.path aside
DOCS_COMMAND = (
    "examples/identity_lora.yaml model.path=Qwen/Qwen2-VL-72B-Instruct method.type=full "
    "data.cutoff_len=2048 data.packing=false train.micro_batch_size=1 --gpus 8 --gpu-memory 24GiB"
)


def run_yaml(root: Path, model_dir: Path, method: str, **sections) -> Path:
    cfg = {
        "model": {"path": str(model_dir), **sections.pop("model", {})},
        "method": {"type": method},
        "data": {"datasets": ["never-read.json"], "cutoff_len": 2048, "packing": False},
        "train": {"micro_batch_size": 1, **sections.pop("train", {})},
        "output": {"dir": str(root / "out")},
    }
    path = root / f"{model_dir.name}-{method}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def config_dir(root: Path, name: str, config) -> Path:
    path = root / name
    path.mkdir(exist_ok=True)
    if isinstance(config, dict):
        (path / "config.json").write_text(json.dumps(config))
    else:
        config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen2_vl_72b(tmp_path_factory):
    """docs/distributed.md's command (field note 2's setting: 8 GPUs of 24 GiB, sequences of
    2048, one row per micro-batch, no packing, model.dtype auto, planned for full
    fine-tuning; LoRA, freeze and QLoRA are planned beside it) on the model's config.json."""
    from keel.cli import parse_args

    root = tmp_path_factory.mktemp("qwen2-vl-72b")
    model_dir = config_dir(root, "qwen2-vl-72b", QWEN2_VL_72B)
    args = parse_args(["plan", *DOCS_COMMAND.split()])
    overrides = [o for o in args.overrides if not o.startswith("model.path=")]
    cfg = load_config(ROOT / args.config, [*overrides, f"model.path={model_dir}"])
    return plan_run(cfg, devices=detect_devices(gpus=args.gpus, memory=args.gpu_memory))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-qwen2-vl")
    return root, config_dir(root, "tiny-qwen2-vl", qwen2_vl_config(build_qwen2_vl_tokenizer()))


def tiny_plan(tiny_qwen, method="full", *, devices=None, **vision):
    root, model_dir = tiny_qwen
    path = run_yaml(root, model_dir, method, model={"vision": vision})
    devices = devices or DeviceSpec(kind="cuda", per_node=2, memory_bytes=80 * GIB)
    return plan_run(load_config(path), devices=devices, precision=FP32)


def total_gib(plan, strategy, method, checkpointing) -> float:
    return round(plan.option_for(strategy, method, checkpointing).per_device.total / GIB, 2)


def test_72b_tower_projector_and_language_model_counted_apart(qwen2_vl_72b):
    full = qwen2_vl_72b.censuses["full"]
    assert full.part_params(TOWER) == TOWER_72B
    assert full.part_params(PROJECTOR) == PROJECTOR_72B
    assert full.part_params(LANGUAGE) == LANGUAGE_72B
    # model.vision defaults: tower and projector frozen, the language model trains
    assert full.trainable_params == full.part_params(LANGUAGE, trainable_only=True)
    assert full.trainable_params == LANGUAGE_72B
    lora = qwen2_vl_72b.censuses["lora"]  # adapters on the language model only
    assert lora.part_params(TOWER, trainable_only=True) == 0
    assert lora.part_params(PROJECTOR, trainable_only=True) == 0
    assert lora.trainable_params == 210_534_400  # r=16 all-linear on 80 decoder layers
    vision = to_json(qwen2_vl_72b)["model"]["vision"]
    assert vision["tower"] == {"params": TOWER_72B, "trainable_params": 0}
    assert vision["tokens_per_image"] == 589824 // 28**2 == 752
    assert vision["patches_per_image"] == 752 * 4


def test_field_note_2_qwen2_vl_72b_on_8x24gib(qwen2_vl_72b):
    """The numbers docs/distributed.md shows (GiB per device of 21.6 usable)."""
    plan = qwen2_vl_72b
    expected = {
        ("ddp", "full", True): (1230.66, False),
        ("fsdp", "full", False): (178.63, False),
        ("fsdp", "full", True): (155.36, False),
        ("fsdp", "lora", True): (48.45, False),  # the frozen base in fp32 (model.dtype auto)
        ("fsdp", "qlora", True): (18.76, True),  # NF4 base
        ("fsdp_offload", "full", True): (19.93, True),
        ("fsdp_offload", "lora", True): (14.30, True),
    }
    for (strategy, method, ckpt), (gib, fits) in expected.items():
        assert total_gib(plan, strategy, method, ckpt) == gib, (strategy, method, ckpt)
        assert plan.option_for(strategy, method, ckpt).fits is fits
    rec = plan.recommendation
    assert (rec.strategy, rec.method, rec.gradient_checkpointing) == ("fsdp_offload", "full", True)
    # The replicated tower + projector stay on the device under CPU offload (no FSDP unit)
    vision = [t for t in plan.censuses["full"].tensors if t.replicated]
    assert rec.per_device.params == sum(t.nbytes for t in vision)
    assert rec.per_device.params >= (TOWER_72B + PROJECTOR_72B) * 4  # fp32, + buffers
    text = summary(plan)
    assert "vision tower 631,183,360 (0 trainable)" in text
    assert "replicated whole on every rank" in text
    assert "1 per sequence assumed" in text and "752 tokens" in text


def _docs_rows() -> list[list[str]]:
    """The cells of docs/distributed.md's Qwen2-VL-72B table."""
    text = DOCS_PAGE.read_text(encoding="utf-8")
    assert DOCS_COMMAND in text  # the command the fixture runs is the page's
    after = text.split("Qwen2-VL-72B on 8 GPUs of 24 GiB", 1)[1].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("| strategy"))
    rows = []
    for line in after[start + 2 :]:
        if not line.startswith("|"):
            return rows
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_docs_table_is_what_the_plan_computes(qwen2_vl_72b):
    plan, modes = qwen2_vl_72b, {"off": False, "on": True}
    rows = _docs_rows()
    assert len(rows) == 6
    for strategy, method, ckpt, total, host, fits in rows:
        said, _, bf16 = total.replace("*", "").partition(" (")
        for mode, gib in zip(ckpt.split(" / "), said.split(" / "), strict=True):
            option = plan.option_for(strategy, method, modes[mode])
            assert f"{option.per_device.total / GIB:.{len(gib.partition('.')[2])}f}" == gib
            assert f"{option.host_bytes / GIB:.1f}" == host
            assert option.fits is (fits.strip("*") == "yes")
        if bf16:  # the same option with model.dtype=bfloat16 (frozen weights in bf16)
            census = plan.censuses[method].with_frozen_itemsize(2)
            option = plan.estimate(strategy, method, modes[ckpt], census=census)
            assert f"{option.per_device.total / GIB:.1f}" == re.match(r"[\d.]+", bf16)[0]


def test_tower_and_projector_are_whole_on_every_rank(tiny_qwen):
    plan = tiny_plan(tiny_qwen, freeze_tower=False, freeze_projector=False)
    census = plan.censuses["full"]
    vision = [t for t in census.tensors if t.part != LANGUAGE]
    assert vision and all(t.unit == REPLICATED and t.trainable for t in vision if not t.buffer)
    tower = sum(t.nbytes for t in vision)
    for world in (2, 4):
        fsdp = state_bytes(census, "fsdp", world, tensors=vision)
        ddp = state_bytes(census, "ddp", world, tensors=vision)
        # weights, gradients and AdamW's two moments unsharded (+ a 4-byte step each)
        steps = 4 * sum(1 for t in vision if t.trainable)
        assert fsdp == ddp == (tower, tower, 2 * tower + steps)
    # The language model's weights do shard: FSDP2's params are below a replica's by them
    ddp = plan.option_for("ddp", "full", False).per_device
    fsdp = plan.option_for("fsdp", "full", False).per_device
    language = state_bytes(
        census, "fsdp", 2, tensors=[t for t in census.tensors if t not in vision]
    )
    assert fsdp.params == tower + language[0] < ddp.params


def test_freeze_switches_set_what_trains(tiny_qwen):
    frozen = tiny_plan(tiny_qwen).censuses["full"]
    assert frozen.part_params(TOWER, trainable_only=True) == 0
    assert frozen.part_params(PROJECTOR, trainable_only=True) == 0
    projector = tiny_plan(tiny_qwen, freeze_projector=False).censuses
    assert projector["full"].part_params(PROJECTOR, trainable_only=True) > 0
    assert projector["full"].part_params(TOWER, trainable_only=True) == 0
    # LoRA: adapters on the language model; the trainable projector a full copy
    lora = projector["lora"]
    assert lora.part_params(PROJECTOR, trainable_only=True) == frozen.part_params(PROJECTOR)
    assert lora.part_params(TOWER, trainable_only=True) == 0


def test_image_activations_grow_with_image_max_pixels(tiny_qwen):
    def activations(pixels: int, **switches) -> int:
        plan = tiny_plan(tiny_qwen, image_max_pixels=pixels, **switches)
        assert plan.work.vision.tokens_per_image == pixels // 28**2
        return plan.option_for("ddp", "full", False).per_device.activations

    small, large = activations(112 * 112), activations(448 * 448)
    assert large > small  # the pixels alone, with the tower frozen
    trained_small = activations(112 * 112, freeze_tower=False)
    trained_large = activations(448 * 448, freeze_tower=False)
    # A training tower keeps its blocks' activations: 16x the patches, 16x its share
    assert trained_small - small > 0
    assert trained_large - large == pytest.approx(16 * (trained_small - small), rel=0.01)


def test_llava_takes_a_fixed_number_of_tokens_per_image(tmp_path):
    config = llava_config(build_llava_tokenizer())
    for pixels in (56 * 56, 1024 * 1024):
        assert image_budget(config, pixels) == (16, 16)  # (56 / 14)^2, any image size
    plan = plan_run(
        load_config(run_yaml(tmp_path, config_dir(tmp_path, "llava", config), "lora")),
        devices=DeviceSpec(kind="cuda", per_node=2, memory_bytes=80 * GIB),
        precision=FP32,
    )
    census = plan.censuses["lora"]
    assert census.part_params(TOWER) > 0 and census.part_params(PROJECTOR) > 0
    assert plan.work.vision.tokens_per_image == 16


def test_text_models_plan_without_a_vision_part(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
    }
    plan = plan_run(
        load_config(run_yaml(tmp_path, config_dir(tmp_path, "text", config), "full")),
        devices=DeviceSpec(kind="cuda", per_node=2, memory_bytes=80 * GIB),
        precision=FP32,
    )
    census = plan.censuses["full"]
    assert not census.is_vision and census.projector_width == 0
    assert all(t.part == LANGUAGE and t.unit != REPLICATED for t in census.tensors)
    assert plan.work.vision is None and plan.work.images == 0
    assert "vision" not in to_json(plan)["model"] and "images:" not in summary(plan)


def test_context_parallel_splits_the_text_but_not_the_images(tiny_qwen):
    """distributed.context_parallel 2 on a vision-language model: the language model's
    activations are a part of the row's, but each process encodes the row's images and
    keeps the whole row's embeddings (its part is a view of them)."""
    from dataclasses import replace

    from keel.plan.estimate import estimate
    from keel.plan.vision import VisionTraining, vision_activation_bytes

    root, model_dir = tiny_qwen
    devices = DeviceSpec(kind="cuda", per_node=2, memory_bytes=80 * GIB)

    def plan(cp: int):
        cfg = load_config(run_yaml(root, model_dir, "full"), [f"distributed.context_parallel={cp}"])
        return plan_run(cfg, devices=devices, precision=FP32)

    whole, split = plan(1), plan(2)
    assert split.work.tokens * 2 == whole.work.tokens and split.work.images == whole.work.images

    def saved(plan, work) -> int:
        census = plan.censuses["full"]
        option = estimate(census, plan.shapes, devices, work, strategy="ddp", checkpointing=False)
        return option.per_device.activations

    text = saved(split, replace(split.work, vision=None))
    training = VisionTraining(
        tower=False, projector=False, checkpointing=False, compute=4, hidden=split.shapes.hidden
    )
    images = vision_activation_bytes(split.work.vision, split.work.images, training)
    embeddings = whole.work.tokens * 4 * split.shapes.hidden  # fp32, the whole row
    assert saved(split, split.work) == text + images + embeddings
    assert split.option_for("ddp", "full", False).per_device.activations < (
        whole.option_for("ddp", "full", False).per_device.activations
    )
