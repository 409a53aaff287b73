"""keel.models.adapters: full/freeze/LoRA, saving, and reloading with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from keel.config.schema import FreezeConfig, LoraConfig, MethodConfig
from keel.errors import ModelError
from keel.models.adapters import (
    apply_method,
    count_parameters,
    load_for_inference,
    method_problems,
    save_model_dir,
)
from keel.models.loading import load_model, load_tokenizer

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])  # [1, T]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits  # [1, T, V]


def lora_method(targets="all-linear", r=4) -> MethodConfig:
    return MethodConfig(type="lora", lora=LoraConfig(r=r, alpha=8.0, dropout=0.0, targets=targets))


def randomize_lora_b(model, seed: int = 0) -> None:
    # PEFT starts lora_B at zero (the adapter is a no-op); parity tests need a real delta.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.fixture
def base(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.float32).eval()


def test_full_trains_everything():
    model = build_tiny_model(320)
    model.requires_grad_(False)
    model = apply_method(model, MethodConfig(type="full"), log=lambda s: None)
    trainable, total = count_parameters(model)
    assert trainable == total > 0


def test_freeze_trains_last_layers_and_named_modules():
    model = build_tiny_model(320, layers=3)
    method = MethodConfig(
        type="freeze", freeze=FreezeConfig(trainable_layers=1, trainable_modules=["norm"])
    )
    logs = []
    model = apply_method(model, method, log=logs.append)
    expected = {n for n, _ in model.named_parameters() if n.startswith("model.layers.2.")} | {
        "model.norm.weight"
    }
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
    assert any("trainable" in line for line in logs)
    model(IDS, labels=IDS).loss.backward()  # frozen parameters really get no gradient
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in expected), name


def test_freeze_negative_layers_train_the_first_ones():
    """LLaMA-Factory's freeze_trainable_layers: -N: the first N decoder layers train."""
    model = build_tiny_model(320, layers=3)
    method = MethodConfig(type="freeze", freeze=FreezeConfig(trainable_layers=-1))
    model = apply_method(model, method, log=lambda s: None)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("model.layers.0.") for n in trained)


def test_freeze_expanded_blocks_train_the_last_layer_of_each_group():
    """LLaMA Pro: a 6-layer model expanded by 2 blocks (one after each 3-layer group) trains
    layers 2 and 5, the inserted ones; 4 groups do not divide 6 layers."""
    model = build_tiny_model(320, layers=6)
    freeze = FreezeConfig(trainable_layers=2, expanded_blocks=True)
    logs = []
    model = apply_method(model, MethodConfig(type="freeze", freeze=freeze), log=logs.append)
    trained = {n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {"2", "5"}
    assert "decoder layers 2, 5 of 6" in "\n".join(logs)
    uneven = FreezeConfig(trainable_layers=4, expanded_blocks=True)
    (problem,) = method_problems(build_tiny_model(320, layers=6), MethodConfig(type="freeze",
                                                                              freeze=uneven))  # fmt: skip
    assert "decoder layers do not split into 4 groups" in problem


def test_freeze_bad_names_suggest_close_ones():
    method = MethodConfig(
        type="freeze",
        freeze=FreezeConfig(trainable_layers=1, trainable_modules=["lm_haed", "norm"]),
    )
    with pytest.raises(ModelError, match=r"'lm_haed' \(did you mean lm_head"):
        apply_method(build_tiny_model(320), method)
    too_many = MethodConfig(type="freeze", freeze=FreezeConfig(trainable_layers=5))
    with pytest.raises(ModelError, match="outside -2..2"):
        apply_method(build_tiny_model(320), too_many)


def test_method_problems_lists_everything_and_changes_nothing():
    model = build_tiny_model(320)
    model.requires_grad_(False)
    method = MethodConfig(
        type="freeze", freeze=FreezeConfig(trainable_layers=3, trainable_modules=["lm_haed"])
    )
    problems = method_problems(model, method)
    assert [p.split(" ", 1)[0] for p in problems] == [
        "method.freeze.trainable_layers",
        "method.freeze.trainable_modules:",
    ]
    assert count_parameters(model)[0] == 0  # checking marked nothing trainable
    with pytest.raises(
        ModelError,
        match=r"(?s)cannot be applied:\n  - method.freeze.trainable_layers.*\n  - method.freeze.trainable_modules",
    ):
        apply_method(model, method)
    assert method_problems(model, lora_method(["q_proj"])) == []
    assert method_problems(model, MethodConfig(type="full")) == []


def test_freeze_refuses_modules_without_weights():
    method = MethodConfig(
        type="freeze", freeze=FreezeConfig(trainable_layers=0, trainable_modules=["act_fn"])
    )
    with pytest.raises(ModelError, match="nothing would train"):
        apply_method(build_tiny_model(320), method)


def freeze_patterns(*patterns: str, layers: int = 0) -> MethodConfig:
    return MethodConfig(
        type="freeze", freeze=FreezeConfig(trainable_layers=layers, trainable_params=list(patterns))
    )


def test_freeze_patterns_train_exactly_the_parameters_they_match_from_the_start():
    model = build_tiny_model(320, layers=3)
    # "up_proj" alone would match no name from its start; ".*" reaches inside names
    method = freeze_patterns(r"model\.layers\.[01]\.mlp\.", r".*\.2\.self_attn\.q_proj")
    model = apply_method(model, method, log=lambda s: None)
    expected = {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("model.layers.0.mlp.", "model.layers.1.mlp."))
    } | {"model.layers.2.self_attn.q_proj.weight"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
    model(IDS, labels=IDS).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in expected), name


def test_freeze_patterns_add_to_the_last_layers():
    model = build_tiny_model(320, layers=3)
    model = apply_method(model, freeze_patterns(r"model\.norm\.", layers=1), log=lambda s: None)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.norm.weight" in trained
    assert {n.split(".")[2] for n in trained if n.startswith("model.layers.")} == {"2"}


def test_freeze_pattern_on_a_tied_output_layer_trains_the_shared_matrix():
    model = build_tiny_model(320)  # tied: named_parameters() lists only the embeddings
    logs = []
    model = apply_method(model, freeze_patterns("lm_head"), log=logs.append)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.requires_grad
    assert count_parameters(model)[0] == model.lm_head.weight.numel()
    assert any("share one weight" in line for line in logs)


def test_freeze_patterns_refused_when_broken_or_matching_nothing():
    model = build_tiny_model(320)
    problems = method_problems(model, freeze_patterns("model.layers.[0", "up_proj", "lm_head"))
    assert len(problems) == 2, problems
    assert "'model.layers.[0' is not a regular expression" in problems[0]
    assert "'up_proj' matches no parameter name" in problems[1]
    assert "names look like model." in problems[1] and ".*" in problems[1]
    assert count_parameters(model)[0] == count_parameters(model)[1]  # nothing was changed


def test_lora_empty_targets_refused():
    with pytest.raises(ModelError, match="method.lora.targets is empty"):
        apply_method(build_tiny_model(320), lora_method([]))


def test_lora_counts_match_formula():
    from peft import PeftModel

    model = build_tiny_model(320)
    shapes = [m.weight.shape for n, m in model.named_modules() if n.endswith(("q_proj", "v_proj"))]
    peft_model = apply_method(model, lora_method(["q_proj", "v_proj"]), log=lambda s: None)
    assert isinstance(peft_model, PeftModel)
    trainable, total = count_parameters(peft_model)
    assert trainable == sum(4 * (out_f + in_f) for out_f, in_f in shapes)
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)


def test_lora_all_linear_skips_lm_head():
    peft_model = apply_method(build_tiny_model(320), lora_method(), log=lambda s: None)
    short = {t.rsplit(".", 1)[-1] for t in peft_model.peft_config["default"].target_modules}
    assert short == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_lora_without_dropout_does_no_dropout_work():
    """dropout 0: PEFT's lora_dropout is an identity (no mask drawn, no multiply, no RNG
    use), so the step pays nothing for it; dropout > 0 keeps real dropout modules."""
    without = apply_method(build_tiny_model(320), lora_method(), log=lambda s: None)
    dropouts = [m for n, m in without.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Identity) for m in dropouts)
    method = lora_method()
    method.lora.dropout = 0.1
    with_dropout = apply_method(build_tiny_model(320), method, log=lambda s: None)
    assert any(isinstance(m, torch.nn.Dropout) for m in with_dropout.modules())


def test_lora_unknown_target_lists_model_names():
    with pytest.raises(
        ModelError, match=r"'q_prj' \(did you mean q_proj.*this model has: .*down_proj"
    ):
        apply_method(build_tiny_model(320), lora_method(["q_prj", "v_proj"]))


def test_adapter_save_reload_parity(base, tiny_model_dir, tiny_tokenizer, tmp_path):
    from peft import PeftModel

    live = apply_method(base, lora_method(), log=lambda s: None)
    randomize_lora_b(live)
    save_model_dir(live, tiny_tokenizer, tmp_path / "out")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    reloaded = PeftModel.from_pretrained(
        load_model(tiny_model_dir, dtype=torch.float32), tmp_path / "out"
    )
    torch.testing.assert_close(logits(reloaded.eval()), logits(live), atol=1e-6, rtol=0)


def test_merged_lora_matches_and_live_model_stays_unmerged(base, tiny_tokenizer, tmp_path):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    live = apply_method(base, lora_method(), log=lambda s: None)
    randomize_lora_b(live)
    before = logits(live)
    with live.disable_adapter():  # the adapter must really change the output
        assert not torch.allclose(before, logits(live), atol=1e-3)
    save_model_dir(live, tiny_tokenizer, tmp_path / "merged", merged=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(logits(merged), before, atol=1e-5, rtol=0)
    assert isinstance(live, PeftModel)
    layers = [m for m in live.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(m.merged for m in layers)
    torch.testing.assert_close(logits(live), before, atol=0, rtol=0)


def test_full_save_reload_parity(tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_tiny_model(len(tiny_tokenizer)).eval()
    save_model_dir(model, tiny_tokenizer, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(reloaded), logits(model), atol=0, rtol=0)
    assert load_tokenizer(tmp_path).chat_template == tiny_tokenizer.chat_template


def test_load_for_inference_from_output_dir(base, tiny_model_dir, tiny_tokenizer, tmp_path):
    from peft import PeftModel

    live = apply_method(base, lora_method(["q_proj"]), log=lambda s: None)
    randomize_lora_b(live)
    out = tmp_path / "run"
    save_model_dir(live, tiny_tokenizer, out)
    quiet = {"cache_dir": tmp_path / "cache", "log": lambda s: None}
    model, tokenizer = load_for_inference(str(out), None, **quiet)
    assert isinstance(model, PeftModel) and not model.training
    assert tokenizer.pad_token == tiny_tokenizer.pad_token
    torch.testing.assert_close(logits(model), logits(live), atol=1e-6, rtol=0)
    model2, _ = load_for_inference(str(tiny_model_dir), str(out), **quiet)
    torch.testing.assert_close(logits(model2), logits(live), atol=1e-6, rtol=0)
    with pytest.raises(ModelError, match="can't also pass --adapter"):
        load_for_inference(str(out), str(out), **quiet)
    with pytest.raises(ModelError, match="no adapter_config.json"):
        load_for_inference(str(tiny_model_dir), str(tmp_path), **quiet)


def test_load_for_inference_plain_dir(tiny_model_dir, tmp_path):
    model, _ = load_for_inference(str(tiny_model_dir), None, cache_dir=tmp_path, log=lambda s: None)
    assert not model.training and next(model.parameters()).dtype is torch.float32


# --- method.lora.modules_to_save ---------------------------------------------------------


def _full_modules_method(*names) -> MethodConfig:
    lora = LoraConfig(r=4, alpha=8.0, dropout=0.0, modules_to_save=list(names))
    return MethodConfig(type="lora", lora=lora)


def _perturb_full_copies(model) -> None:
    """Move the trained copies off the base's values, as training would."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".modules_to_save." in name:
                p.add_(torch.randn_like(p) * 0.05)


def _untied(model):
    from transformers import LlamaForCausalLM

    config = model.config
    config.tie_word_embeddings = False
    untied = LlamaForCausalLM(config)
    untied.load_state_dict(model.state_dict())
    return untied


@pytest.mark.parametrize("tied", [True, False])
def test_modules_to_save_train_in_full_and_reload(tied, base, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    logs = []
    source = base if tied else _untied(base)
    if not tied:  # a base whose output layer is its own matrix
        source.save_pretrained(tmp_path / "base")
    live = apply_method(source, _full_modules_method("lm_head"), log=logs.append)
    randomize_lora_b(live)
    _perturb_full_copies(live)
    trained = sorted(n for n, p in live.named_parameters() if p.requires_grad and "lora" not in n)
    lm = live.get_base_model()
    if tied:  # one matrix: naming the output layer trains the embeddings it is
        assert trained == ["base_model.model.model.embed_tokens.modules_to_save.default.weight"]
        assert lm.get_input_embeddings().weight is lm.get_output_embeddings().weight
        assert any("embed_tokens and lm_head share one weight" in line for line in logs)
    else:
        assert trained == ["base_model.model.lm_head.modules_to_save.default.weight"]
    assert any(line.endswith("trained in full: lm_head") for line in logs)
    before = logits(live)
    with live.disable_adapter():  # the reference: the base, not the trained copies
        torch.testing.assert_close(logits(live), logits(source), atol=0, rtol=0)
    save_model_dir(live, base_tokenizer := load_tokenizer(tiny_model_dir), tmp_path / "adapter")
    base_dir = tiny_model_dir if tied else tmp_path / "base"
    reloaded = PeftModel.from_pretrained(
        load_model(base_dir, dtype=torch.float32), tmp_path / "adapter"
    )
    torch.testing.assert_close(logits(reloaded.eval()), before, atol=1e-6, rtol=0)
    save_model_dir(live, base_tokenizer, tmp_path / "merged", merged=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(logits(merged), before, atol=1e-5, rtol=0)


def test_modules_to_save_problems_name_the_key():
    problems = method_problems(build_tiny_model(320), _full_modules_method("lm_haed", "norm"))
    assert (
        len(problems) == 1
        and "method.lora.modules_to_save: no module named 'lm_haed'" in problems[0]
    )
    assert "did you mean lm_head" in problems[0]
    both = MethodConfig(
        type="lora", lora=LoraConfig(targets=["q_proj", "v_proj"], modules_to_save=["q_proj"])
    )
    (problem,) = method_problems(build_tiny_model(320), both)
    assert "both name q_proj" in problem


def test_lora_layers_adapt_only_those_decoder_layers(tmp_path):
    """method.lora.layers (PEFT's layers_to_transform): the targets of layer 1 alone; the
    saved adapter says so, and a run that keeps training it reads them from there."""
    from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig
    from keel.config.start_adapter import with_start_adapter

    model = build_tiny_model(320, layers=3)
    method = MethodConfig(type="lora", lora=LoraConfig(r=4, dropout=0.0, layers=[1]))
    logs = []
    peft = apply_method(model, method, log=logs.append)
    adapted = {n.split(".")[4] for n, _ in peft.named_parameters() if "lora_A" in n}
    assert adapted == {"1"}
    assert "of decoder layers 1" in "\n".join(logs)
    save_model_dir(peft, build_tiny_tokenizer(), tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["layers_to_transform"] == [1]
    cfg = RunConfig(
        model=ModelConfig(path="m", adapter=str(tmp_path / "adapter")),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(tmp_path / "out")),
    )
    continued, problems = with_start_adapter(cfg, {})
    assert problems == [] and continued.method.lora.layers == [1]
    _, problems = with_start_adapter(cfg, {"lora": {"layers": [0, 1]}})
    assert "method.lora.layers = [0, 1], but model.adapter" in problems[0]
    for layers, said in (([3], "3 is not a decoder layer index of this model (0..2)"),
                         ([1, 1], "names a layer twice")):  # fmt: skip
        wrong = MethodConfig(type="lora", lora=LoraConfig(layers=layers))
        assert said in "\n".join(method_problems(build_tiny_model(320, layers=3), wrong))
