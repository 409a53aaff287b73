"""LLaMA-Factory's chat-template names as keel's data.template: a model family's own
format is the tokenizer's chat template (auto); their ChatML is keel's chatml; their
generic prompt formats (alpaca, vicuna, ...) have no keel counterpart."""

from __future__ import annotations

from keel.config.dialects.report import KeyFate

# Their generic formats, not any model's own: keel renders chat only through a model's
# template, its builtin chatml, or a .jinja file.
_GENERIC = {"alpaca", "default", "empty", "fewshot", "vicuna", "custom", "aeva"}

_CHATML = {
    "chatml": "ChatML without a default system prompt, as keel's chatml",
    "chatml_de": "ChatML; keel's chatml adds no default (German) system prompt",
}

# Their templates named after a model family (data/template.py's register_template names).
_FAMILIES = (
    "bailing bailing_v2 breeze chatglm3 cohere cpm4 dbrx deepseek deepseek3 deepseekr1 hy3 "
    "deepseekcoder dots_ocr ernie ernie_nothink ernie_vl exaone falcon falcon_h1 gemma gemma2 "
    "gemma3 gemma3n gemma4 gemma4n glm4 glm4_moe glm4v glm4_5v glm_ocr glm4_7 glmz1 gpt_oss "
    "granite3 granite3_vision granite4 index hunyuan hunyuan_small hy_dense_1_8b hy_dense_7b "
    "intern2 intern_vl intern_s1 keye_vl kimi_vl lfm2 lfm2_vl llama2 llama2_zh llama3 llama4 "
    "mllama moonlight moss_vl llava llava_next llava_next_llama3 llava_next_mistral "
    "llava_next_qwen llava_next_yi llava_next_video llava_next_video_mistral "
    "llava_next_video_yi mimo mimo_v2 mimo_vl minicpm_v minicpm_v_4_6 minicpm_o minimax1 "
    "minimax2 ministral mistral mistral_small ministral3 olmo openchat openchat-3.6 opencoder "
    "paligemma paligemma_chat phi phi_small phi4 phi4_mini pixtral qwen qwen3 qwen3_nothink "
    "qwen2_audio qwen2_omni qwen3_omni qwen3_omni_nothink qwen2_vl qwen3_vl qwen3_vl_nothink "
    "qwen3_5 qwen3_5_nothink qwen3_6 sailor seed_coder seed_oss smollm smollm2 solar starchat "
    "telechat2 xuanyuan yi yi_vl youtu youtu_vl yuan zephyr"
).split()


def template_fate(key: str, value) -> tuple[KeyFate, str | None]:
    """(the fate of `template: value`, keel's data.template, or None when refused)."""
    name = str(value)
    if name in _CHATML:
        return KeyFate(key, "mapped", "data.template", f"chatml: {_CHATML[name]}"), "chatml"
    if name in _FAMILIES:
        family = name.removesuffix("_nothink")
        why = (
            f"auto: {name} is the {family} models' own chat format, so keel uses the "
            f"tokenizer's chat template of model.path (a {family} model's)"
        )
        if name.endswith("_nothink"):
            why += "; whether it adds empty <think> tags is the tokenizer template's choice"
        return KeyFate(key, "mapped", "data.template", why), "auto"
    if name in _GENERIC:
        why = (
            f"{name} is a generic prompt format, not a model's own; keel renders chat with "
            f"the tokenizer's template (auto), chatml, or a .jinja file: set template to the "
            f"model's own (e.g. qwen3) or chatml"
        )
        return KeyFate(key, "refused", why=why), None
    why = f"{name} is not a LLaMA-Factory template keel knows; use the model's own or chatml"
    return KeyFate(key, "refused", why=why), None
