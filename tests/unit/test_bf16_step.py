"""bf16 on a CPU: every matrix multiply of the step runs in bf16, master weights stay fp32,
and the loss stays within a stated tolerance of fp32."""

import torch
from conftest import TINY_DECODER
from torch.utils._python_dispatch import TorchDispatchMode

from keel.precision import Precision
from keel.train.loop import Trainer
from keel.train.objective import CausalLMObjective

# bf16 keeps 8 bits of mantissa: one step's summed CE over ~30 tokens of a random model
# lands within ~0.5% of fp32 (measured 0.3% over 4 steps); a loss 2% off would mean a
# wrong cast somewhere.
BF16_LOSS_RTOL = 2e-2
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu"}
MATMULS |= {f"{name}_backward" for name in MATMULS}


class MatmulDtypes(TorchDispatchMode):
    """Counts the matrix multiplies that run, by their first input's dtype."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in MATMULS or name.startswith("_scaled_dot_product"):
            key = f"{name}:{str(args[0].dtype).removeprefix('torch.')}"
            self.seen[key] = self.seen.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def tiny_lora_trainer(precision: str) -> Trainer:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, attn_implementation="sdpa", **TINY_DECODER)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    objective = CausalLMObjective(model, chunk_size=8)
    objective.fast_head = objective.check_fast_head()[0]
    assert objective.fast_head
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    return Trainer(
        objective=objective,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0),
        precision=Precision(precision, "test"),
        device=torch.device("cpu"),
        pad_id=0,
        max_grad_norm=1.0,
    )


def batch_rows() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for n in (17, 9, 12):
        ids = torch.randint(3, 96, (n + 1,), generator=generator).tolist()
        rows.append(
            {
                "input_ids": ids[:-1],
                "targets": [-100, *ids[2:]],
                "position_ids": list(range(n)),
                "num_targets": n - 1,
            }
        )
    return rows


def step(trainer: Trainer) -> float:
    rows = batch_rows()
    targets = sum(r["num_targets"] for r in rows)
    tokens = sum(len(r["input_ids"]) for r in rows)
    result = trainer.train_step(
        [rows], window_targets=targets, window_tokens=tokens, filler=rows[0]
    )
    return float(result.loss_sum) / targets


def test_bf16_step_runs_every_matmul_in_bf16_and_keeps_fp32_master_weights():
    trainer = tiny_lora_trainer("bf16")
    with MatmulDtypes() as counted:
        step(trainer)
    fp32 = {k: v for k, v in counted.seen.items() if k.endswith(":float32")}
    assert not fp32, f"matrix multiplies left in fp32 under bf16: {fp32}"
    assert any(k.startswith("mm:") for k in counted.seen), counted.seen
    assert any("scaled_dot_product" in k for k in counted.seen), counted.seen
    trainable = [p for p in trainer.objective.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    state = trainer.optimizer.state[trainable[0]]
    assert state["exp_avg"].dtype == torch.float32


def test_bf16_loss_within_tolerance_of_fp32_and_training_follows():
    fp32, bf16 = tiny_lora_trainer("fp32"), tiny_lora_trainer("bf16")
    losses = {"fp32": [step(fp32) for _ in range(4)], "bf16": [step(bf16) for _ in range(4)]}
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert abs(a - b) <= BF16_LOSS_RTOL * abs(a), losses
    assert losses["bf16"][-1] < losses["bf16"][0], losses  # it trains
