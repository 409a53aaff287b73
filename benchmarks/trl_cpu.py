"""What the keel-vs-TRL benchmarks give TRL alike: its trainer arguments for one CPU process
that saves and reports nothing mid-run, the fp32 sdpa model, and the LoRA of the jobs
(r=16, alpha=32, all linear layers, no dropout: keel's side uses the same)."""

from __future__ import annotations

from pathlib import Path


def cpu_trainer_args(seed: int) -> dict:
    """transformers TrainingArguments shared by SFTConfig and DPOConfig runs: no
    accumulation, cosine schedule, a log line every step, no checkpoints, no reporting, no
    gradient checkpointing, no fp16, data loaded in the training process."""
    return dict(
        gradient_accumulation_steps=1,
        lr_scheduler_type="cosine",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=seed,
        dataloader_num_workers=0,
    )


def load_model(folder: Path):
    """The benchmark's model in fp32 with transformers' sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
