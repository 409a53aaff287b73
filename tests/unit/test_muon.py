"""train.optimizer muon: torch's Muon (at AdamW's RMS) on the weight matrices, AdamW on the
rest, in one optimizer; which weights each takes."""

import copy

import pytest
import torch

from keel.config.schema import TrainConfig
from keel.models.trainable import muon_weights
from keel.train.muon import MuonAdamW, orthogonalise
from keel.train.optim import build_optimizer


def tiny_llama(tied: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def step_both(model, *optimizers_and_models, steps: int = 3):
    """The same loss and gradients into each (optimizer, model) pair, `steps` times."""
    ids = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for optimizer, copy_of in optimizers_and_models:
            copy_of(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def test_the_matrices_step_as_torchs_muon_and_the_rest_as_adamw():
    model = tiny_llama()
    train = TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.1)
    mine = build_optimizer(model, train)
    matrices = [p for g in mine.param_groups if g["muon"] for p in g["params"]]
    assert len(matrices) == 14  # q, k, v, o, gate, up, down of 2 layers

    twin = copy.deepcopy(model)
    by_name = dict(twin.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    twin_matrices = [by_name[names[id(p)]] for p in matrices]
    matrix_ids = {id(p) for p in twin_matrices}
    rest = [p for p in twin.parameters() if id(p) not in matrix_ids]
    torch_muon = torch.optim.Muon(
        twin_matrices, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    decays = [p for p in rest if p.ndim >= 2]
    torch_adamw = torch.optim.AdamW(
        [{"params": decays, "weight_decay": 0.1},
         {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}], lr=0.02,
    )  # fmt: skip

    class Both:
        def step(self):
            torch_muon.step()
            torch_adamw.step()

        def zero_grad(self):
            torch_muon.zero_grad()
            torch_adamw.zero_grad()

    step_both(model, (mine, model), (Both(), twin))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, by_name[name], rtol=0, atol=0, msg=name)
    start = dict(tiny_llama().named_parameters())
    moved = model.model.layers[0].mlp.up_proj.weight - start["model.layers.0.mlp.up_proj.weight"]
    assert moved.abs().max() > 1e-3  # it trained


def test_weight_rule_on_tied_lora_and_experts():
    tied = tiny_llama(tied=True)
    names = {id(p): n for n, p in tied.named_parameters()}
    chosen = sorted(names[i] for i in muon_weights(tied))
    assert len(chosen) == 14 and not any("embed" in n or "norm" in n for n in chosen)

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(
        tiny_llama(),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                   use_dora=True),
    )  # fmt: skip
    names = {id(p): n for n, p in lora.named_parameters()}
    chosen = {names[i] for i in muon_weights(lora)}
    assert chosen and all(".lora_A." in n or ".lora_B." in n for n in chosen)
    assert len(chosen) == 8  # A and B of q and v in 2 layers; not the DoRA magnitudes
    trained = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert any("lm_head.modules_to_save" in n for n in trained - chosen)  # AdamW

    from transformers import AutoConfig, AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16,
        )
    )  # fmt: skip
    names = {id(p): n for n, p in moe.named_parameters()}
    chosen = {names[i] for i in muon_weights(moe)}
    assert {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    } <= chosen


def test_orthogonalised_updates():
    generator = torch.Generator().manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(24, 24, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator))
    spread = torch.logspace(-2, 1, 16)  # singular values from 0.01 to 10
    update = left[:, :16] @ torch.diag(spread) @ right.T
    singular = torch.linalg.svdvals(orthogonalise(update).float())
    assert singular.min() > 0.3 and singular.max() < 1.3  # near 1, whatever they were
    # a fused experts weight: each expert's matrix orthogonalised by itself
    experts = torch.randn(3, 6, 10, generator=generator)
    batched = orthogonalise(experts)
    for i in range(3):
        torch.testing.assert_close(batched[i], orthogonalise(experts[i]), rtol=0, atol=1e-2)


def test_checkpoint_state_round_trips():
    model = tiny_llama()
    optimizer = build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02))
    step_both(model, (optimizer, model), steps=1)
    restored = MuonAdamW(
        [{**{k: v for k, v in g.items() if k != "params"}, "params": g["params"]}
         for g in optimizer.param_groups]
    )  # fmt: skip
    restored.load_state_dict(optimizer.state_dict())
    matrix = model.model.layers[0].self_attn.q_proj.weight
    assert set(restored.state[matrix]) == {"momentum_buffer", "step"}
    torch.testing.assert_close(
        restored.state[matrix]["momentum_buffer"], optimizer.state[matrix]["momentum_buffer"]
    )


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_weight_decay_is_decoupled(weight_decay):
    param = torch.nn.Parameter(torch.ones(4, 4))
    optimizer = MuonAdamW([{"params": [param], "muon": True, "weight_decay": weight_decay}], lr=0.1)
    param.grad = torch.zeros(4, 4)  # no update direction: only the decay moves it
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.full((4, 4), 1 - 0.1 * weight_decay))


@pytest.mark.parametrize(
    ("keys", "optimizer", "fates"),
    [
        ({"use_muon": True}, "muon", {"use_muon": "mapped"}),
        ({"use_muon": True, "optim": "adamw_torch"}, "muon", {"optim": "ignored"}),
        ({"use_muon": False, "optim": "adamw_8bit"}, "adamw_8bit", {"use_muon": "ignored"}),
    ],
)
def test_llamafactory_use_muon(keys, optimizer, fates):
    from pathlib import Path

    from keel.config.dialects.llamafactory import translate_llamafactory

    raw = {
        "model_name_or_path": "m", "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "d", "template": "qwen", "output_dir": "o", **keys,
    }  # fmt: skip
    translation = translate_llamafactory(raw, Path("x.yaml"))
    assert translation.refused() == []
    assert translation.config["train"]["optimizer"] == optimizer
    assert {f.key: f.fate for f in translation.fates if f.key in fates} == fates


def test_axolotls_muon_is_refused_naming_the_scaling():
    from pathlib import Path

    from keel.config.dialects.axolotl import translate_axolotl

    raw = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}
    translation = translate_axolotl({**raw, "optimizer": "muon"}, Path("x.yml"))
    (refused,) = translation.refused()
    assert refused.key == "optimizer" and "sqrt(rows / columns)" in refused.why
