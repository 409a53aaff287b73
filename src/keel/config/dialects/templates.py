"""LLaMA-Factory's and Axolotl's chat-template names as keel's data.template: a model
family's own format is the tokenizer's chat template (auto); their ChatML is keel's chatml;
their generic prompt formats (alpaca, vicuna, metharme, ...) have no keel counterpart."""

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


# Axolotl's chat_template names for a model family's format -> the family, for the report
_AXOLOTL_FAMILIES = {
    "llama3": "Llama 3 Instruct",
    "llama3_2_vision": "Llama 3.2 Vision",
    "llama4": "Llama 4",
    "qwen_25": "Qwen2.5",
    "qwen3": "Qwen3",
    "qwen3_5": "Qwen3.5",
    "qwen2_vl": "Qwen2-VL",
    "mistral_v1": "Mistral",
    "mistral_v2v3": "Mistral",
    "mistral_v3_tekken": "Mistral",
    "mistral_v7_tekken": "Mistral",
    "pixtral": "Pixtral",
    "llava": "LLaVA",
    "gemma": "Gemma",
    "gemma3": "Gemma 3",
    "gemma3n": "Gemma 3n",
    "gemma4": "Gemma 4",
    "phi_3": "Phi-3",
    "phi_35": "Phi-3.5",
    "cohere": "Command-R",
    "command_a": "Command A",
    "aya": "Aya",
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
    "jamba": "Jamba",
    "falcon_h1": "Falcon-H1",
    "nemotron_h": "Nemotron-H",
    "exaone": "EXAONE",
    "exaone4": "EXAONE 4",
}


def axolotl_template_fate(key: str, value) -> tuple[KeyFate, str | None]:
    """(the fate of Axolotl's `chat_template: value`, keel's data.template, or None when
    refused)."""
    name = str(value)
    if value is None or name == "tokenizer_default":
        return KeyFate(key, "mapped", "data.template", "the tokenizer's own chat template"), "auto"
    if name.startswith("tokenizer_default_fallback_"):
        why = (
            "the tokenizer's own chat template; keel has no fallback: a tokenizer without one "
            "is refused, naming the fix"
        )
        return KeyFate(key, "mapped", "data.template", why), "auto"
    if name == "chatml":
        return KeyFate(key, "mapped", "data.template"), "chatml"
    family = _AXOLOTL_FAMILIES.get(name)
    if family is not None:
        why = (
            f"Axolotl's {name} is the {family} chat format; keel uses the tokenizer's own "
            f"template, which is that format for a {family} tokenizer"
        )
        return KeyFate(key, "mapped", "data.template", why), "auto"
    why = (
        f"{value!r}: keel's templates are the tokenizer's own (auto), chatml, or a .jinja "
        f"file (data.template)"
    )
    return KeyFate(key, "refused", why=why), None
