"""Axolotl's unfrozen_parameters as keel's method freeze: their patterns keep their meaning
(matched from the start of a name, dots literal unless a + follows) and train exactly the
parameters Axolotl's freeze_layers_except would leave unfrozen."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import build_tiny_model
from vlm_support import build_qwen2_vl_tokenizer, build_tiny_qwen2_vl

from keel.config import load_config
from keel.config.dialects.axolotl import translate_axolotl
from keel.models.adapters import apply_method

BASE = {"base_model": "bundled:smollm2-135m-instruct", "datasets": [{"path": "d.jsonl"}]}


def _translate(**keys):
    return translate_axolotl({**BASE, **keys}, Path(__file__))


def _their_unfrozen(model, patterns: list[str]) -> set[str]:
    """What Axolotl leaves unfrozen (axolotl.utils.freeze.LayerNamePattern, restated):
    re.match with every dot not before a + made literal."""
    compiled = [re.compile(re.sub(r"\.(?!\+)", "\\.", p)) for p in patterns]
    return {n for n, _ in model.named_parameters() if any(c.match(n) for c in compiled)}


def _trained(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _apply(translation, model):
    """`model` trained as the translated config says (keel's loader reads it first)."""
    # any file that exists: the loader checks the data path, nothing here reads the data
    config = {**translation.config, "data": {"datasets": [{"path": __file__}]}}
    cfg = load_config(None, base=config)
    return apply_method(model, cfg.method, log=lambda s: None, vision=cfg.model.vision)


def test_patterns_become_method_freeze_with_their_dots():
    translation = _translate(unfrozen_parameters=["model.layers.[0-1]+.mlp", "lm_head.*"])
    method = translation.config["method"]
    assert method == {
        "type": "freeze",
        "freeze": {
            "trainable_layers": 0,
            "trainable_params": [r"model\.layers\.[0-1]+\.mlp", r"lm_head\.*"],
        },
    }
    assert translation.refused() == []
    assert not any("method.type = full" in note for note in translation.notes)


@pytest.mark.parametrize(
    "patterns",
    [
        ["model.layers.1.*", "lm_head"],  # a text model: the last layer and the tied head
        ["model.layers.[0-1]+.self_attn.q_proj", "model.norm"],
        ["model.layers.1+.mlp.up_proj"],  # "1+": the dot before it stays a wildcard
    ],
)
def test_a_text_model_trains_what_axolotl_leaves_unfrozen(patterns):
    model = build_tiny_model(320)
    want = _their_unfrozen(build_tiny_model(320), patterns)
    model = _apply(_translate(unfrozen_parameters=patterns, adapter=None), model)
    trained = _trained(model)
    if "lm_head" in patterns:  # tied: named_parameters lists the shared matrix once
        want |= {"model.embed_tokens.weight"}
    assert trained == want and want


def test_their_qwen35_example_trains_the_language_model_and_not_the_vision_tower():
    """examples/qwen3.5/27b-fft.yaml's patterns ("Freeze vision encoder") on a tiny Qwen2-VL,
    whose language model and tower are named as Qwen3.5's."""
    patterns = ["model.language_model.*", "lm_head.*"]
    model = build_tiny_qwen2_vl(build_qwen2_vl_tokenizer())
    model = _apply(_translate(unfrozen_parameters=patterns), model)
    trained = _trained(model)
    names = [n for n, _ in model.named_parameters()]
    assert trained == {n for n in names if n.startswith(("model.language_model.", "lm_head."))}
    assert any(n.startswith("model.visual.") for n in names)
    assert not any(n.startswith("model.visual.") for n in trained)


def test_with_an_adapter_or_row_ranges_they_are_refused_with_the_fix():
    fates = {
        f.key: f
        for f in _translate(
            adapter="lora", lora_r=8, lora_alpha=16, unfrozen_parameters=["lm_head"]
        ).fates
    }
    assert fates["unfrozen_parameters"].fate == "refused"
    assert "lora_modules_to_save" in fates["unfrozen_parameters"].why
    ranged = {f.key: f for f in _translate(unfrozen_parameters=["^lm_head.weight$[:32000]"]).fates}
    assert ranged["unfrozen_parameters"].fate == "refused"
    assert "ranges of their rows" in ranged["unfrozen_parameters"].why
    empty = _translate(unfrozen_parameters=[])
    assert empty.config["method"] == {"type": "full"} and empty.refused() == []


# Axolotl's freeze_mm_modules (axolotl.utils.freeze), restated: a parameter whose name has
# one of these components is frozen.
_THEIR_MM_PREFIXES = (
    "vision_tower", "vision_model", "vision_encoder", "embed_vision", "multi_modal_projector",
    "visual", "audio_tower", "audio_model", "embed_audio",
)  # fmt: skip


@pytest.mark.parametrize("model_name", ["qwen2_vl", "llava"])
@pytest.mark.parametrize("freeze", [True, False, None])
def test_freeze_mm_modules_trains_what_axolotls_full_fine_tuning_trains(model_name, freeze):
    """Full fine-tuning of a vision-language model (processor_type set): with
    freeze_mm_modules true the tower and projector stay frozen, as Axolotl freezes them;
    false or left out, everything trains, as in Axolotl (keel's own default freezes them)."""
    from vlm_support import build_llava_tokenizer, build_tiny_llava

    from keel.models.vision import family_of

    build = {
        "qwen2_vl": lambda: build_tiny_qwen2_vl(build_qwen2_vl_tokenizer()),
        "llava": lambda: build_tiny_llava(build_llava_tokenizer()),
    }[model_name]
    keys = {"processor_type": "AutoProcessor"}
    if freeze is not None:
        keys["freeze_mm_modules"] = freeze
    model = _apply(_translate(**keys), build())
    names = {n for n, _ in build().named_parameters()}
    frozen = {n for n in names if set(n.split(".")) & set(_THEIR_MM_PREFIXES)} if freeze else set()
    # tower weights the forward never reads (LLaVA's layers after vision_feature_layer) get
    # no gradient in either tool; keel freezes them
    family = family_of(model.config)
    unused = tuple(f"{path}." for path in family.unused_parameters(model.config))
    assert _trained(model) == {n for n in names - frozen if not n.startswith(unused)}
    assert frozen or not freeze  # the negative control: there is something to freeze


def test_freeze_mm_modules_with_lora_asks_for_nothing_more():
    translation = _translate(adapter="lora", lora_r=8, lora_alpha=16, freeze_mm_modules=False)
    assert "vision" not in translation.config.get("model", {})
    assert not translation.refused()
