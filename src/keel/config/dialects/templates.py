"""LLaMA-Factory's and Axolotl's chat-template names as keel's data.template: a model
family's own format is the tokenizer's chat template (auto) when the model is of that family
(families.py checks it); their ChatML is keel's chatml; their generic prompt formats (alpaca,
vicuna, metharme, ...) have no keel counterpart."""

from __future__ import annotations

from keel.config.dialects.build import Build
from keel.config.dialects.families import Choices, Model, family_fate, model_of
from keel.config.dialects.report import KeyFate
from keel.config.schema import is_inline_template

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


# Their family templates whose models share an architecture -> those model types (a type's
# variants count: qwen3 covers qwen3_moe). A family template not listed here serves models
# of several architectures (deepseekr1: Qwen and Llama distillations) and is not checked.
_LLAMAFACTORY_TYPES = {
    **dict.fromkeys(("llama3", "llama2", "llama2_zh", "yi", "smollm", "smollm2"), ("llama",)),
    "llama4": ("llama4",),
    "mllama": ("mllama",),
    "qwen": ("qwen", "qwen2"),
    **dict.fromkeys(("qwen3", "qwen3_nothink"), ("qwen3",)),
    **dict.fromkeys(("qwen3_5", "qwen3_5_nothink"), ("qwen3_5",)),
    "qwen2_vl": ("qwen2_vl", "qwen2_5_vl"),
    **dict.fromkeys(("qwen3_vl", "qwen3_vl_nothink"), ("qwen3_vl",)),
    "qwen2_audio": ("qwen2_audio",),
    "qwen2_omni": ("qwen2_5_omni",),
    **dict.fromkeys(("qwen3_omni", "qwen3_omni_nothink"), ("qwen3_omni",)),
    "mistral": ("mistral", "mixtral"),
    "ministral3": ("ministral3", "mistral3"),
    **dict.fromkeys(("gemma", "gemma2"), ("gemma", "gemma2")),
    "gemma3": ("gemma3",),
    "gemma3n": ("gemma3n",),
    "gemma4": ("gemma4",),
    **dict.fromkeys(("paligemma", "paligemma_chat"), ("paligemma",)),
    **dict.fromkeys(("phi", "phi4", "phi4_mini"), ("phi3",)),
    "llava": ("llava",),
    **dict.fromkeys(
        ("llava_next", "llava_next_llama3", "llava_next_mistral", "llava_next_qwen"),
        ("llava_next",),
    ),
    **dict.fromkeys(("llava_next_video", "llava_next_video_mistral"), ("llava_next_video",)),
    "gpt_oss": ("gpt_oss",),
    "seed_oss": ("seed_oss",),
    **dict.fromkeys(("glm4", "glmz1"), ("glm", "glm4")),
    "glm4v": ("glm4v",),
    "cohere": ("cohere",),
    "dbrx": ("dbrx",),
    "exaone": ("exaone",),
    "falcon_h1": ("falcon_h1",),
    "granite3": ("granite", "granitemoe"),
    "lfm2": ("lfm2",),
    **dict.fromkeys(("ernie", "ernie_nothink"), ("ernie4_5",)),
}
_LLAMAFACTORY = Choices(types=_LLAMAFACTORY_TYPES, own="leave template out")


def template_fate(key: str, value, model: Model) -> tuple[KeyFate, str | None]:
    """(the fate of `template: value` for `model`, keel's data.template, or None when
    refused)."""
    name = str(value)
    if name in _CHATML:
        return KeyFate(key, "mapped", "data.template", f"chatml: {_CHATML[name]}"), "chatml"
    if name in _FAMILIES:
        family = name.removesuffix("_nothink")
        fate = family_fate(key, name, family, model, _LLAMAFACTORY)
        if name.endswith("_nothink") and fate.fate == "mapped":
            why = f"{fate.why}; whether it adds empty <think> tags is that template's choice"
            fate = KeyFate(key, "mapped", fate.target, why)
        return fate, "auto" if fate.fate == "mapped" else None
    if name in _GENERIC:
        why = (
            f"{name} is a generic prompt format, not a model's own; keel renders chat with "
            f"the tokenizer's template (auto), chatml, or a .jinja file: set template to the "
            f"model's own (e.g. qwen3) or chatml"
        )
        return KeyFate(key, "refused", why=why), None
    why = f"{name} is not a LLaMA-Factory template keel knows; use the model's own or chatml"
    return KeyFate(key, "refused", why=why), None


# Axolotl's chat_template names for a model family's format -> (the family, its model types)
_AXOLOTL_FAMILIES = {
    "llama3": ("Llama 3 Instruct", ("llama",)),
    "llama3_2_vision": ("Llama 3.2 Vision", ("mllama",)),
    "llama4": ("Llama 4", ("llama4",)),
    "qwen_25": ("Qwen2.5", ("qwen2",)),
    "qwen3": ("Qwen3", ("qwen3",)),
    "qwen3_5": ("Qwen3.5", ("qwen3_5",)),
    "qwen2_vl": ("Qwen2-VL", ("qwen2_vl", "qwen2_5_vl")),
    "mistral_v1": ("Mistral", ("mistral", "mixtral")),
    "mistral_v2v3": ("Mistral", ("mistral", "mixtral")),
    "mistral_v3_tekken": ("Mistral", ("mistral", "mixtral")),
    "mistral_v7_tekken": ("Mistral", ("mistral", "mistral3")),
    "pixtral": ("Pixtral", ("llava", "pixtral")),
    "llava": ("LLaVA", ("llava",)),
    "gemma": ("Gemma", ("gemma", "gemma2")),
    "gemma3": ("Gemma 3", ("gemma3",)),
    "gemma3n": ("Gemma 3n", ("gemma3n",)),
    "gemma4": ("Gemma 4", ("gemma4",)),
    "phi_3": ("Phi-3", ("phi3",)),
    "phi_35": ("Phi-3.5", ("phi3",)),
    "cohere": ("Command-R", ("cohere", "cohere2")),
    "command_a": ("Command A", ("cohere2",)),
    "aya": ("Aya", ("cohere", "aya_vision")),
    "deepseek_v2": ("DeepSeek-V2", ("deepseek_v2",)),
    "deepseek_v3": ("DeepSeek-V3", ("deepseek_v3",)),
    "jamba": ("Jamba", ("jamba",)),
    "falcon_h1": ("Falcon-H1", ("falcon_h1",)),
    "nemotron_h": ("Nemotron-H", ("nemotron_h",)),
    "exaone": ("EXAONE", ("exaone",)),
    "exaone4": ("EXAONE 4", ("exaone4",)),
}
_AXOLOTL = Choices(
    types={name: types for name, (_, types) in _AXOLOTL_FAMILIES.items()},
    own="set chat_template: tokenizer_default",
)


def axolotl_template_fate(key: str, value, model: Model) -> tuple[KeyFate, str | None]:
    """(the fate of Axolotl's `chat_template: value` for `model`, keel's data.template, or
    None when refused)."""
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
    if name in _AXOLOTL_FAMILIES:
        fate = family_fate(key, name, _AXOLOTL_FAMILIES[name][0], model, _AXOLOTL)
        return fate, "auto" if fate.fate == "mapped" else None
    why = (
        f"{value!r}: keel's templates are the tokenizer's own (auto), chatml, or one of your "
        f"own (chat_template: jinja with chat_template_jinja)"
    )
    return KeyFate(key, "refused", why=why), None


def llamafactory_template(build: Build, key: str, value) -> None:
    """LLaMA-Factory's `template` as data.template, checked against model_name_or_path."""
    model = model_of(build.raw, "model_name_or_path", "model_revision", build.model_override)
    _record(build, template_fate(key, value, model))


def axolotl_chat_template(build: Build, key: str, value) -> None:
    """Axolotl's `chat_template` as data.template, checked against base_model. `jinja`
    (or left empty beside chat_template_jinja) is their own template: that key sets it."""
    if value == JINJA or (value is None and build.raw.get(JINJA_KEY)):
        if build.raw.get(JINJA_KEY):
            build.mapped(key, "data.template", f"{value}: the template {JINJA_KEY} gives")
        else:
            build.refused(key, f"jinja needs {JINJA_KEY}: the template, or a .jinja file")
        return
    model = model_of(build.raw, "base_model", "revision_of_model", build.model_override)
    _record(build, axolotl_template_fate(key, value, model))


def axolotl_chat_template_jinja(build: Build, key: str, value) -> None:
    """Axolotl's own chat template (the Jinja text, or a file holding it), used when
    chat_template is jinja or left out: data.template takes either as it is."""
    chosen = build.raw.get("chat_template")
    if not value:
        build.ignored(key, "empty: no template of their own")
    elif chosen not in (None, JINJA):
        build.ignored(key, f"chat_template is {chosen!r}: Axolotl reads {key} only with jinja")
    elif is_inline_template(str(value)):
        build.put(key, "data.template", str(value), "the template itself (shown as inline)")
    else:
        build.put(key, "data.template", str(value), "a template file, relative to where keel runs")


JINJA, JINJA_KEY = "jinja", "chat_template_jinja"  # Axolotl's choice of its own template


def _record(build: Build, found: tuple[KeyFate, str | None]) -> None:
    fate, template = found
    if template is not None:
        build.set("data.template", template)
    build.fates.append(fate)
