"""The reward model's objective (train.stage rm): a scalar score per sequence, chosen
against rejected with the Bradley-Terry loss (keel.losses.reward).

A pair row holds its chosen then its rejected sequence laid end to end (keel.data:
`sequence_index` numbers them, `labels` [1, 0] per pair; padding-free, with the pair's
prompt laid out once, keel.data.shared_prompt). The backbone runs without its
output layer: no vocabulary-sized logits at all. Each sequence is scored by the `score` head
(Linear(hidden, 1, bias=False), as transformers' *ForSequenceClassification) on the hidden
state of its last token: the token transformers' *ForSequenceClassification (and so TRL's
RewardTrainer) reads, the last non-padding one.

The head is a submodule of this objective, so it trains under every method (LoRA and QLoRA
freeze only the model's base weights), the checkpoint holds it (the objective's state dict),
DDP and FSDP2 wrap it with the objective (the FSDP root unit), and
keel.models.sequence_classifier writes it as the `score` of a *ForSequenceClassification
folder. Its initial value comes from (train.seed, its name), as transformers initialises it
(normal(0, initializer_range)), so 1 and N processes start from the same head.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import torch
from torch import nn

from keel.distributed.context_parallel import group_sum
from keel.losses.reward import bradley_terry_loss
from keel.models.vision.family import VisionFamily
from keel.stages.base import ObjectiveOutput, Stage, StageSettings
from keel.train.objective import CausalLMObjective, causal_lm_of, decoder_of
from keel.train.preference import share_of_group

HEAD = "score"  # transformers' name of a *ForSequenceClassification model's head


def head_initial_value(shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    """The head's fp32 initial value: normal(0, std) from a generator seeded by (seed, name),
    the same on every process."""
    digest = hashlib.sha256(f"{seed}:{HEAD}.weight".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def last_positions(batch: dict) -> torch.Tensor:
    """[S]: the flat position (row * T + column) of each sequence's last token, where
    transformers' *ForSequenceClassification reads its score (the last non-padding token):
    the answer's end-of-turn token, or what the chat template writes after it (ChatML's
    newline). Reading the same token keeps the exported model's scores equal to keel's."""
    index = batch["sequence_index"]  # [B, T], -1 on padding
    real = index >= 0
    flat = torch.arange(index.numel(), device=index.device).view_as(index)  # [B, T]
    count = batch["labels"].shape[0]
    last = torch.full((count,), -1, dtype=torch.long, device=index.device)
    return last.scatter_reduce(0, index[real], flat[real], reduce="amax")


def sequence_ends(batch: dict) -> list[int]:
    """Each sequence's last token in a padding-free micro-batch's one row, from the layout's
    lengths (under context parallelism the row's tokens are split, its lengths are whole):
    a sample per sequence (`seq_lens`), or a pair's prompt once and its two answers after it
    (`prefix_groups`). The padding pseudo-sample at the end is no sequence."""
    count = batch["labels"].shape[0]
    groups = batch.get("prefix_groups")
    if groups is None:
        return [end - 1 for end in itertools.accumulate(batch["seq_lens"][:count])]
    ends, offset = [], 0
    for prefix, segments in groups:
        offset += prefix
        for length in segments:
            offset += length
            ends.append(offset - 1)
    return ends[:count]


class RewardObjective(CausalLMObjective):
    """forward(batch) -> ObjectiveOutput(loss sum over pairs, pairs, statistics).

    Statistics (TRL's names, `stage.metric_names`): accuracy (chosen scores higher), margin
    (chosen - rejected), mean_reward (every sequence), chosen_reward, rejected_reward.
    """

    reports_perplexity = False  # its eval loss is per pair, sample or completion

    def __init__(
        self,
        model: nn.Module,
        *,
        stage: Stage,
        settings: StageSettings,
        seed: int,
        vision: VisionFamily | None = None,
    ):
        super().__init__(model, vision=vision)
        assert stage.unit == "pair", f"{stage.name} does not train on pairs"
        self.metric_names = stage.metric_names
        self.settings = settings
        self.seed = seed
        lm = causal_lm_of(model)
        text = lm.config.get_text_config()
        embeddings = lm.get_input_embeddings().weight
        self.init_std = getattr(text, "initializer_range", 0.02)
        self.score = nn.Linear(
            text.hidden_size, 1, bias=False, device=embeddings.device, dtype=embeddings.dtype
        )
        if embeddings.device.type != "meta":  # else keel.models.materialize allocates it
            self.init_new_weights(region_of=lambda _t: None, local=lambda t: t)
        _freeze_output_layer(lm)
        # a pair's chosen and rejected sequences share the prompt: computed once for both
        # (a vision-language model's images and 3-D positions keep the sequences whole)
        self.shares_pair_prompts = vision is None

    def init_new_weights(
        self,
        *,
        region_of: Callable[[torch.Tensor], tuple[slice, ...] | None],
        local: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Initialise the head (this process's part of it, under FSDP) from the seed."""
        weight = self.score.weight
        value = head_initial_value(weight.shape, self.init_std, self.seed)
        region = region_of(weight)
        with torch.no_grad():
            local(weight).copy_(value if region is None else value[region])

    def check_fast_head(self, device: torch.device | None = None) -> tuple[bool, str]:
        """The reward model never runs the output layer: nothing to compare."""
        return True, "the reward model scores hidden states with its own head"

    def scores(self, batch: dict) -> torch.Tensor:
        """[S]: each sequence's score, in the order of `batch["labels"]`."""
        lm = causal_lm_of(self.model)
        hidden = decoder_of(lm, self.vision)(**self.inputs(batch)).last_hidden_state  # [B, T, H]
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [B * T, H]
        group = batch.get("cp_group")
        if group is None:
            return self.score(hidden[last_positions(batch)]).squeeze(-1).float()  # [S]
        # Context parallelism: this process holds a part of the one padding-free row, and
        # scores the sequences whose last token is in it; the group adds the scores up
        ends = torch.tensor(sequence_ends(batch), device=hidden.device)  # [S], in the row
        local = ends - torch.distributed.get_rank(group) * hidden.shape[0]
        mine = (local >= 0) & (local < hidden.shape[0])  # [S]
        pooled = hidden[local.clamp(0, hidden.shape[0] - 1)]  # [S, H]
        # every process's scores depend on its hidden states and the head (zero where not
        # its own), so each runs the group's backward exchanges and DDP sees the head's grad
        mine_scores = self.score(pooled).squeeze(-1).float() * mine
        return group_sum(mine_scores, group)

    def forward(self, batch: dict, *, probe: str | None = None):
        if probe:
            return super().forward(batch, probe=probe)
        scores = self.scores(batch)  # [S]
        chosen, rejected = scores[0::2], scores[1::2]  # [P] each
        out = bradley_terry_loss(
            chosen,
            rejected,
            margin=batch.get("margin"),
            center_coefficient=self.settings.center_rewards_coefficient,
        )
        detached = scores.detach()
        values = {
            "accuracy": out.accuracy,
            "margin": out.margin,
            "mean_reward": detached,
            "chosen_reward": detached[0::2],
            "rejected_reward": detached[1::2],
        }
        statistics = torch.stack(
            [part for name in self.metric_names for part in _sum_and_count(values[name])]
        )
        pairs = torch.tensor(float(chosen.shape[0]), device=scores.device)
        return share_of_group(ObjectiveOutput(out.losses.sum(), pairs, statistics), batch)


def _sum_and_count(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return values.float().sum(), torch.tensor(float(values.numel()), device=values.device)


def _freeze_output_layer(lm: nn.Module) -> None:
    """The output layer never runs here: unless it is tied to the input embeddings (which
    do run), freeze it, so that no optimizer state, DDP bucket or checkpoint holds it."""
    head, embeddings = lm.get_output_embeddings(), lm.get_input_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        head.weight.requires_grad_(False)
