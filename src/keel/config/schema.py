"""The run config: one keyword-only dataclass per YAML section.

Field types are the schema: `keel.config.load` checks every value against them (including
`Literal` choices) and reports all problems at once. Cross-field rules live in
`keel.config.validate`. Comments after a field are shown by `keel train --help-config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from keel.stages.base import StageSettings
from keel.stages.registry import STAGE_NAMES, STAGES, stage_sections

BUNDLED_PREFIX = "bundled:"


@dataclass(kw_only=True)
class VisionConfig:
    # Vision-language models only (Qwen2-VL, LLaVA, ...); ignored for text models
    freeze_tower: bool = True  # the vision encoder does not train (LoRA never adapts it)
    freeze_projector: bool = True  # the projector (image features -> LM inputs) does not train
    image_max_pixels: int = 589824  # larger images are resized down to this many (768*768)
    image_min_pixels: int = 1024  # smaller images are resized up to this many (32*32)


@dataclass(kw_only=True)
class ModelConfig:
    path: str  # HF model directory, Hugging Face Hub id (owner/name), or bundled:NAME
    revision: str = "main"  # Hub ids only: the branch, tag or commit sha to use
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # weight storage dtype
    # auto: the fastest the model and machine support (flash_attention_2 on a CUDA GPU with
    # flash-attn installed, else sdpa where the architecture has it, else eager); logged
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    cache_dir: str = "~/.cache/keel"  # where bundled models are converted to safetensors
    trust_remote_code: bool = False  # run the model repository's own Python code (transformers)
    # a PEFT LoRA or OFT adapter folder of this model to keep training (method lora or
    # qlora, or oft; e.g. an sft run's output for a dpo run): its adapter_config.json fixes
    # method.lora's r, alpha, targets, rslora, dora and modules_to_save (method.oft's
    # block_size, targets, cayley_neumann and modules_to_save)
    adapter: str | None = None
    vision: VisionConfig = field(default_factory=VisionConfig)  # vision-language models
    # tokens to add to the tokenizer, each then one token (e.g. [<think>, </think>]); a new
    # one gets the next id, its embedding row starts at the mean of the known rows and
    # trains (LoRA and freeze: the input and output embeddings train in full); the saved
    # tokenizer and model hold them. Tokens already in the vocabulary stay as they are
    add_tokens: list[str] = field(default_factory=list)
    # the same as special tokens: never split, dropped when decoding with
    # skip_special_tokens (e.g. [<|im_start|>, <|im_end|>] for ChatML on a base model)
    add_special_tokens: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 16  # LoRA rank
    alpha: float = 32.0  # LoRA scale is alpha / r
    dropout: float = 0.05  # on the LoRA input; 0 costs no work at all
    targets: str | list[str] = "all-linear"  # "all-linear" or module names, e.g. [q_proj, v_proj]
    rslora: bool = False  # rank-stabilised LoRA: the scale is alpha / sqrt(r), not alpha / r
    # DoRA (PEFT's use_dora): each adapted layer's weight as a trained magnitude per output
    # feature times LoRA's direction; more compute and activation memory than LoRA
    dora: bool = False
    # LoRA+: the B matrices learn at train.lr x this (their paper suggests 16); unset: one lr
    plus_lr_ratio: float | None = None
    # modules that train in full beside the adapters, e.g. [embed_tokens, lm_head] (PEFT's
    # modules_to_save); the adapter folder holds their trained weights. Tied input and
    # output embeddings stay one matrix: naming either trains both
    modules_to_save: list[str] = field(default_factory=list)
    # a mixture of experts' fused routed experts to adapt too, by parameter name (PEFT's
    # target_parameters), e.g. [experts.gate_up_proj, experts.down_proj]: each gets rank r
    # per expert. The weight plus its LoRA is formed once per forward (a copy of the
    # layer's experts), dropout must be 0, and DoRA does not apply
    target_parameters: list[str] = field(default_factory=list)
    # decoder layer indices whose modules the targets adapt (PEFT's layers_to_transform),
    # e.g. LLaMA Pro's expanded blocks (keel expand names them); []: every layer
    layers: list[int] = field(default_factory=list)
    # how the adapters start. default: A random, B zero (training starts from the base);
    # gaussian: A from N(0, 1/r); pissa: A and B from each weight's top-r singular vectors
    # and values (PiSSA), olora: from its QR decomposition's first r columns of Q and rows
    # of R (OLoRA); under both the frozen base keeps the rest of the weight (faster to
    # converge), the saved adapter is converted to a plain LoRA of rank 2r that applies to
    # the unchanged base (PEFT's conversion), and a reference model is a frozen copy of it
    init: Literal["default", "gaussian", "pissa", "olora"] = "default"
    # pissa: randomised SVD iterations (torch.svd_lowrank; LLaMA-Factory's pissa_iter
    # default); 0: the exact SVD, slow for large weights
    pissa_iters: int = 16


@dataclass(kw_only=True)
class OftConfig:
    # Orthogonal fine-tuning (PEFT's OFT; LLaMA-Factory's finetuning_type oft): each adapted
    # linear layer's input is turned by a trained block-diagonal rotation before its frozen
    # weight, so the weight's norms and the angles between its neurons are kept. A block of
    # b inputs trains b(b-1)/2 numbers: a layer with d inputs trains d(b-1)/2. A layer whose
    # inputs block_size does not divide gets the nearest size that does (PEFT's rule), which
    # the run's log names
    block_size: int = 32  # inputs per rotation block
    targets: str | list[str] = "all-linear"  # "all-linear" or module names, e.g. [q_proj, v_proj]
    # the rotation as the Cayley transform's Neumann series (5 terms; PEFT's default): no
    # matrix inverse, slightly off orthogonal; false: the exact transform (a solve per step)
    cayley_neumann: bool = True
    # modules that train in full beside the rotations, as method.lora.modules_to_save
    modules_to_save: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class FreezeConfig:
    trainable_layers: int = 2  # train the last N decoder layers (-N: the first N)
    trainable_modules: list[str] = field(default_factory=list)  # extra names, e.g. [lm_head, norm]
    # regular expressions over parameter names as the model spells them (e.g.
    # model.layers.3.mlp.up_proj.weight): a parameter trains when one matches from the
    # name's start (Python's re.match), e.g. ['lm_head', 'model\.layers\.1[0-5]\.mlp\.'];
    # these train beside the last trainable_layers (set it to 0 to train only what they match)
    trainable_params: list[str] = field(default_factory=list)
    # LLaMA Pro (LLaMA-Factory's use_llama_pro): trainable_layers N trains the last layer of
    # each of N equal groups of layers, the blocks a block expansion inserted, not the last
    # N; the model's layer count must divide by N
    expanded_blocks: bool = False


@dataclass(kw_only=True)
class QloraConfig:
    # Used with method.type qlora (LoRA as in method.lora, on a quantised frozen base)
    quant: Literal["nf4"] = "nf4"  # the frozen base linear layers' storage
    # dtype the base weights are dequantised to for each matmul; auto: bfloat16 when
    # training in bf16 (or fp16 on a GPU without bf16: float16), else float32
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # torchao: NF4 tensors (one process, DDP, FSDP2); bnb: bitsandbytes Linear4bit (one
    # process and DDP only)
    quant_backend: Literal["torchao", "bnb"] = "torchao"
    # a mixture of experts' routed experts (their fused [experts, ...] weights, most of such
    # a model) in NF4 too, dequantised when a layer's experts run and again in backward
    # (the experts block recomputes: no dequantised copy is kept): far less memory, slower
    # steps (much slower on a CPU); torchao only
    quantize_experts: bool = False


@dataclass(kw_only=True)
class QatConfig:
    # Quantization-aware training (method full or freeze; torchao): the decoder layers'
    # linear layers compute with weights (and activations) rounded as this post-training
    # quantization scheme rounds them, so the model learns around the rounding; the output
    # is the trained weights at full precision, and `keel export --quantize` applies the
    # scheme. int8-int4: int8 activations, int4 weights per group (CPUs, ExecuTorch);
    # int4: int4 weights per group (CUDA); fp8: fp8 activations and weights (H100 on)
    scheme: Literal["none", "int8-int4", "int4", "fp8"] = "none"
    group_size: int = 32  # int8-int4 and int4: input features per weight scale
    # steps before this one train without the rounding (Axolotl's fake_quant_after_n_steps)
    start_step: int = 0


@dataclass(kw_only=True)
class MethodConfig:
    type: Literal["full", "freeze", "lora", "qlora", "oft"] = "lora"  # which weights train, and how
    lora: LoraConfig = field(default_factory=LoraConfig)  # lora and qlora
    oft: OftConfig = field(default_factory=OftConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    qlora: QloraConfig = field(default_factory=QloraConfig)
    qat: QatConfig = field(default_factory=QatConfig)  # full and freeze

    @property
    def uses_lora(self) -> bool:
        """LoRA adapters on a frozen base (lora, or qlora on a quantised base)."""
        return self.type in ("lora", "qlora")

    @property
    def uses_adapter(self) -> bool:
        """A PEFT adapter on a frozen base (LoRA, QLoRA or OFT): the output is an adapter
        folder, a reference model is the base with the adapter switched off."""
        return self.type in ("lora", "qlora", "oft")

    @property
    def reference_by_adapters_off(self) -> bool:
        """A reference model is the policy with its adapters switched off: an adapter on a
        base left as it is. PiSSA and OLoRA move part of each weight into the adapter, so
        the base with the adapter off is not the model the run starts from."""
        return self.uses_adapter and not (self.uses_lora and self.lora.init in ("pissa", "olora"))

    @property
    def adapter(self) -> LoraConfig | OftConfig:
        """The adapter's section (method.lora or method.oft): its targets and
        modules_to_save."""
        return self.oft if self.type == "oft" else self.lora

    @property
    def adapter_key(self) -> str:
        """The config key of that section, for messages: method.lora or method.oft."""
        return "method.oft" if self.type == "oft" else "method.lora"


# The message fields an answer's reasoning is read from, as chat templates read it: vLLM's
# and Qwen3's reasoning_content, gpt-oss's thinking (keel.data.formats)
REASONING_FIELDS = ("reasoning_content", "thinking")


@dataclass(kw_only=True)
class DatasetConfig:
    # a file, a folder, a local HF datasets dir, a name in dataset_info.json, or a Hugging
    # Face Hub dataset id (owner/name) read through the hub cache
    path: str
    # auto (from the first row, for the stage), alpaca, sharegpt, messages, text (pt only);
    # preference (TRL's prompt/chosen/rejected: dpo, orpo, simpo), kto (prompt/completion/
    # label). In a preference stage alpaca, sharegpt and messages read chosen and rejected
    # (LLaMA-Factory's ranking data) or kto_tag as well. prompt (TRL's prompt-only: grpo);
    # grpo reads alpaca, sharegpt and messages rows as prompts too.
    format: Literal[
        "auto", "alpaca", "sharegpt", "messages", "text", "preference", "kto", "prompt"
    ] = "auto"
    # e.g. {prompt: question, response: answer}; preference data: chosen, rejected, kto_tag
    columns: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)  # sharegpt role tags, e.g. {user_tag: human}
    # a file has one split, train; a Hub dataset has its own (train, test, ...); slices as in
    # train[:1000] or train[:10%]
    split: str = "train"
    revision: str = "main"  # Hub dataset names only: the branch, tag or commit sha to use
    # Hub dataset names only: the configuration of its card to read (load_dataset's name;
    # LLaMA-Factory's subset), else its default one
    subset: str | None = None
    # Hub dataset names only: read these files of the repo (paths in it, or glob patterns
    # such as data/*.jsonl) as its train split instead of its card's configuration
    # (load_dataset's data_files)
    files: list[str] = field(default_factory=list)
    max_samples: int | None = None  # use the first N rows (after split and num_samples)
    # Draw N rows with train.seed, as LLaMA-Factory's num_samples does (every row once, then
    # repeats, when N exceeds the rows); overrides the dataset_info.json entry's
    num_samples: int | None = None
    # leave out each row's system prompt (its system column, and system messages); the
    # template's own default system prompt, if it has one, still applies (Axolotl's
    # drop_system_message)
    drop_system: bool = False


@dataclass(kw_only=True)
class DataConfig:
    datasets: list[DatasetConfig]
    dataset_dir: str | None = None  # folder with a LLaMA-Factory dataset_info.json
    # auto (the tokenizer's own), chatml, a path to a .jinja file, or a Jinja template itself
    # (text with {% or {{; the data report calls it inline)
    template: str = "auto"
    # tokens per sample (and per packed row); preference stages: per prompt + one answer,
    # packed rows of pairs up to 2 x cutoff_len
    cutoff_len: int = 1024
    # pt and sft: a sample of fewer tokens is dropped (the report counts them as short); with
    # data.overlength split, so is a piece of a long document (Axolotl's min_sample_len). 0:
    # keep every length
    min_len: int = 0
    packing: bool = False  # several samples per row, attention kept within each sample
    # sft only: the loss covers the prompt too (system, user and tool turns, the template's
    # own tokens), not only the assistant turns (LLaMA-Factory's train_on_prompt, Axolotl's
    # train_on_inputs); image tokens are never trained
    train_on_prompt: bool = False
    # sft only: each conversation's last assistant turn trains, the turns before it are
    # context (LLaMA-Factory's mask_history)
    mask_history: bool = False
    # drop each sample identical to an earlier one (its tokens and what trains), before the
    # split; the report counts them (Axolotl's dataset_exact_deduplication)
    deduplicate: bool = False
    # How several data.datasets are mixed (LLaMA-Factory's mix_strategy): concat keeps every
    # row of each (the shuffle mixes them); interleave_under draws rows from them in turn (or
    # by mix_weights) until the first runs out, interleave_over until each has run out (the
    # others drawn again), interleave_once until each has run out, no row drawn twice.
    # Streamed, each block of rows draws from every dataset; data.eval_datasets are mixed
    # alike
    mix: Literal["concat", "interleave_under", "interleave_over", "interleave_once"] = "concat"
    # interleave_*: each dataset's probability of being drawn, in data.datasets' order (they
    # sum to 1; LLaMA-Factory's interleave_probs); empty: in turn
    mix_weights: list[float] = field(default_factory=list)
    val_size: float = 0.0  # fraction (<1) or number of samples held out for eval
    # evaluation data of its own, read as data.datasets are (the same formats, the stage's
    # data), instead of rows held out by val_size (LLaMA-Factory's eval_dataset)
    eval_datasets: list[DatasetConfig] = field(default_factory=list)
    # Samples over cutoff_len: drop, truncate (cut the end), error, or split (pt: cut a
    # document into pieces of cutoff_len tokens, each trained as a sample, as LLaMA-Factory
    # and Axolotl chunk pretraining text); auto: split for pt, drop for the other stages
    overlength: Literal["auto", "drop", "truncate", "error", "split"] = "auto"
    on_invalid: Literal["error", "skip"] = "error"  # malformed/empty/mis-ordered rows
    shuffle: bool = True  # shuffle the rows each epoch (with train.seed)
    num_proc: int = 1  # processes for tokenization
    # pt and sft: read, check and tokenize the training data as training goes instead of
    # preparing it all first (a corpus too large to tokenize up front or hold in memory).
    # Needs train.max_steps; data.shuffle shuffles the file order each epoch and the rows
    # within each block of 1024; evaluation data: data.eval_datasets (prepared whole)
    streaming: bool = False
    # Bytes one row may hold (a JSONL, CSV or text line, a JSON array element); a larger row
    # is refused (exit 2) naming its file and line before it is parsed. Default 16 MiB
    max_row_bytes: int = 16 * 2**20


@dataclass(kw_only=True)
class TrainConfig:
    # pt: pretraining, sft: supervised, dpo/orpo/simpo: preference pairs, kto: labelled samples
    stage: Literal[STAGE_NAMES] = "sft"
    epochs: float = 1.0  # passes over the training rows; may be fractional
    max_steps: int | None = None  # overrides epochs when set
    micro_batch_size: int = 1  # rows per forward pass, per process (per device)
    grad_accum: int = 1  # micro-batches per step and process (when global_batch_size is unset)
    # Rows per optimizer step over all processes. Unset: micro_batch_size * grad_accum *
    # processes, as in other trainers. Set it for runs that must compute the same steps on
    # any number of processes (the accumulation per process is then derived).
    global_batch_size: int | None = None
    lr: float = 2e-4  # peak learning rate (AdamW)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0  # cosine and linear decay to lr x this (e.g. 0.1), not to 0
    warmup_steps: int = 0  # linear warmup from 0 to lr
    warmup_ratio: float = 0.0  # used when warmup_steps is 0
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    seed: int = 42  # data order, sampling, LoRA initialisation
    # auto: bf16 where it is fast (measured on a CPU; native on a GPU), else fp16 on a GPU,
    # else fp32. fp16 trains with dynamic loss scaling
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # Recompute each decoder layer's activations in backward; offload: also keep the saved
    # layer inputs in pinned host memory until backward (GPU; on a CPU it is plain true)
    gradient_checkpointing: bool | Literal["offload"] = False
    # adamw: fp32 moments; adamw_8bit / adamw_4bit: torchao's block-quantised moments
    # (~4x / ~8x less optimizer memory; the first step compiles them, needs a C compiler);
    # muon: Muon (orthogonalised momentum, scaled to AdamW's RMS, so train.lr means the
    # same) on the weight matrices, AdamW on the embeddings, output layer, norms and biases
    optimizer: Literal["adamw", "adamw_8bit", "adamw_4bit", "muon"] = "adamw"
    # Lay each micro-batch's samples end to end in one row (no compute on padding; the same
    # samples per step, so the same loss) where the model's attention allows it (probed at
    # set-up); false: right-padded rows
    padding_free: bool = True
    eval_every: int = 0  # steps; 0: evaluate at the end only (when a validation split exists)
    # evaluations per epoch instead (every ceil(steps per epoch / N) steps); 0: eval_every
    evals_per_epoch: int = 0
    resume: str = "auto"  # auto (newest complete checkpoint in output.dir), never, or a path
    # A signal that, like SIGTERM, makes every rank finish its step, save a checkpoint and
    # exit 7 (rerun the same command to resume), e.g. SIGUSR1 for SLURM's --signal=USR1@90
    preempt_signal: Literal["none", "SIGUSR1", "SIGUSR2"] = "none"
    # CPU threads for torch, per process; 0: the cores this process may run on, shared
    # among the node's processes. Lower it on a busy machine (keel warns when it is)
    threads: int = 0
    loss_chunk_size: int = 1024  # tokens per chunk of the output-layer + cross-entropy
    # pt and sft on a mixture of experts: the weight of the routers' load-balancing loss
    # added to the loss (transformers' output_router_logits); 0: off, as transformers'
    # default; model: the config's router_aux_loss_coef. Logged as aux_loss
    router_aux_loss_coef: float | Literal["model"] = 0.0
    # pt and sft: weight each target token's cross-entropy by a factor of the model's own
    # prediction there, held constant: dft, its probability of the token (Dynamic
    # Fine-Tuning); eaft, the entropy of its eaft_top_k likeliest next tokens over
    # ln(eaft_top_k), to the power eaft_alpha. Training logs ce_loss, the unweighted one;
    # eval_loss stays unweighted
    token_weighting: Literal["none", "dft", "eaft"] = "none"
    eaft_alpha: float = 1.0  # eaft: the exponent of the normalised entropy (>= 0)
    eaft_top_k: int = 20  # eaft: the likeliest next tokens whose entropy is taken (>= 2)
    # Stop once eval_loss has not improved (by more than early_stopping_threshold) in this
    # many evaluations in a row (every train.eval_every steps), and keep the best
    # evaluation's model as the final one; 0: off
    early_stopping_patience: int = 0
    early_stopping_threshold: float = 0.0


@dataclass(kw_only=True)
class WandbConfig:
    # Used with wandb in output.loggers; unset keys leave the choice to W&B (and its own
    # WANDB_* variables).
    project: str | None = None  # W&B project; unset: W&B's default
    entity: str | None = None  # W&B user or team; unset: your default entity
    name: str | None = None  # the run's display name; unset: the name of output.dir
    tags: list[str] = field(default_factory=list)
    # online | offline (upload later with `wandb sync`) | disabled; unset: WANDB_MODE, else
    # online
    mode: Literal["online", "offline", "disabled"] | None = None


@dataclass(kw_only=True)
class OutputConfig:
    dir: str  # the run's folder: model, metrics, checkpoints (keel refuses folders it did not make)
    save_every: int = 0  # steps; 0: only the final save
    # checkpoints per epoch instead (every ceil(steps per epoch / N) steps); 0: save_every
    saves_per_epoch: int = 0
    keep_last: int = 2  # complete checkpoints kept
    log_every: int = 1  # steps between metrics.jsonl lines (and progress lines)
    # metrics.jsonl is always written; tensorboard and wandb add to it
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = field(
        default_factory=lambda: ["jsonl"]
    )
    wandb: WandbConfig = field(default_factory=WandbConfig)  # with wandb in loggers
    merge_lora: bool = False  # also write a merged HF model to <dir>/merged (LoRA, QLoRA, OFT)
    # replace keel's own files in a non-empty dir; a finished run is replaced even with
    # train.resume=auto (an interrupted one is resumed): keel.train.resume
    overwrite: bool = False


@dataclass(kw_only=True)
class FsdpConfig:
    reshard_after_forward: bool = (
        True  # false: keep layers gathered until backward (faster, more memory)
    )
    cpu_offload: bool = (
        False  # keep sharded parameters, gradients and optimizer state in CPU memory (GPU only)
    )
    # Shard within groups of this many consecutive processes and replicate across the
    # groups (HSDP: e.g. the GPUs of one node, so that only gradient all-reduces cross
    # nodes); must divide the number of processes. 0: shard over all of them
    shard_size: int = 0


@dataclass(kw_only=True)
class DistributedConfig:
    # auto: one process -> no wrapper; several -> fsdp when a full replica would not fit a
    # device, else ddp
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    timeout_s: float = 600.0  # a collective waiting longer than this fails the run
    preprocess_timeout_s: float = 86400.0  # how long other ranks wait for rank 0 to tokenize
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    # Context parallelism: groups of this many consecutive processes split each
    # micro-batch's tokens (attention exchanges heads for tokens inside a group), so a
    # process holds 1/N of a long row's activations; a group reads the same rows (the
    # data-parallel degree is processes / N). Every stage, text and vision-language models
    # (each process encodes the row's images; not Gemma 3, whose image tokens attend both
    # ways). 1: off
    context_parallel: int = 1
    # Tensor parallelism: groups of this many consecutive processes split each decoder
    # layer (attention heads, MLP columns; transformers' plan for the model), so a process
    # holds 1/N of those weights, their gradients and optimizer state, and of the
    # activations inside them; a group reads the same rows (the data-parallel degree is
    # processes / N) and FSDP2 shards the rest over the groups. Dense layers (text and
    # vision-language models' language models); full, freeze and LoRA; every stage. Best
    # within a node (a collective per attention and MLP). 1: off
    tensor_parallel: int = 1
    # Memory of one device (e.g. 24GiB, 80GB); auto: the GPU's, or on a CPU the node's RAM
    # shared by its processes. Used by `keel plan` and by the check before training.
    device_memory: str = "auto"
    # When the memory plan says the run does not fit: enforce (refuse before loading
    # weights, exit 2) or warn (say so, train anyway).
    plan: Literal["enforce", "warn"] = "enforce"


@dataclass(kw_only=True)
class WatchdogConfig:
    enabled: bool = True  # hang detection (several processes) and stall detection (always)
    # Seconds a process may make no progress inside a step or one of keel's collectives,
    # with several processes, before the run counts as hung (reported, then exit 4).
    hang_timeout_s: float = 120.0
    # Seconds one step may take before it counts as stalled; auto: max(60, 10 x the median
    # step time after warm-up).
    stall_timeout_s: float | Literal["auto"] = "auto"
    on_stall: Literal["warn", "abort"] = "warn"  # abort: exit 5 after the report
    # Limit for phases that legitimately take long: loading the model, checkpoint
    # save/load, writing the outputs (rank 0's tokenization uses
    # distributed.preprocess_timeout_s).
    slow_phase_timeout_s: float = 1800.0


def _with_stage_sections(cls: type) -> type:
    """Give `cls` one optional section per stage with settings, named after the stage and
    typed by its registry record (keel.stages.registry.stage_sections), after `train`: a
    stage's settings are declared in its module, and a new stage needs no edit here."""
    own = dict(cls.__annotations__)
    after = list(own).index("train") + 1
    sections = {name: settings | None for name, settings in stage_sections().items()}
    cls.__annotations__ = {**dict(list(own.items())[:after]), **sections}
    cls.__annotations__.update(dict(list(own.items())[after:]))
    for name in sections:
        setattr(cls, name, None)  # unset: the stage's defaults (RunConfig.stage_settings)
    return cls


@dataclass(kw_only=True)
@_with_stage_sections
class RunConfig:
    """The whole run; after `train` come the sections of the stages with settings of their
    own (dpo, orpo, simpo, kto), added from the stage registry by `_with_stage_sections`."""

    model: ModelConfig
    data: DataConfig
    output: OutputConfig
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    @property
    def stage_settings(self) -> StageSettings | None:
        """The section of train.stage (its defaults where the config has none), the one way
        code reads a stage's settings; None for a stage without settings (pt, sft)."""
        stage = STAGES.get(self.train.stage)
        if stage is None or stage.settings is None:
            return None
        section = getattr(self, stage.name, None)  # None also for a stage added at run time
        return section if section is not None else stage.settings()


def is_inline_template(setting: str) -> bool:
    """Whether data.template holds a Jinja template itself rather than naming one (a path
    or a file name holds no Jinja tags)."""
    return "{%" in setting or "{{" in setting
