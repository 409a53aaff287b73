"""Their token-weighted losses as train.token_weighting: LLaMA-Factory's use_dft_loss and
use_eaft_loss, Axolotl's use_eaft with its unnormalised entropy (the factor it puts on the
loss goes into max_grad_norm); the Trainer's eval_strategy in both."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from keel.config import load_config
from keel.config.dialects.axolotl import translate_axolotl
from keel.config.dialects.llamafactory import translate_llamafactory
from keel.losses import TokenWeighting, weighted_cross_entropy_sums

LLAMAFACTORY = {
    "model_name_or_path": "m", "stage": "sft", "do_train": True, "finetuning_type": "full",
    "dataset": "d", "template": "qwen", "output_dir": "o",
}  # fmt: skip
AXOLOTL = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}


def _llamafactory(**keys):
    translation = translate_llamafactory({**LLAMAFACTORY, **keys}, Path("x.yaml"))
    return translation, {f.key: f for f in translation.fates}


def _axolotl(**keys):
    translation = translate_axolotl({**AXOLOTL, **keys}, Path("x.yml"))
    return translation, {f.key: f for f in translation.fates}


@pytest.mark.parametrize(
    ("keys", "train", "ignored"),
    [
        ({"use_dft_loss": True}, {"token_weighting": "dft"}, []),
        ({"use_eaft_loss": True}, {"token_weighting": "eaft"}, []),
        (
            {"use_eaft_loss": True, "eaft_alpha": 2.0},
            {"token_weighting": "eaft", "eaft_alpha": 2.0},
            [],
        ),
        # their trainer reads DFT first
        (
            {"use_dft_loss": True, "use_eaft_loss": True, "eaft_alpha": 2.0},
            {"token_weighting": "dft"},
            ["use_eaft_loss", "eaft_alpha"],
        ),
        ({"use_dft_loss": False}, {}, ["use_dft_loss"]),
        ({"stage": "dpo", "use_dft_loss": True}, {}, ["use_dft_loss"]),
    ],
)
def test_llamafactory_dft_and_eaft(keys, train, ignored):
    translation, fates = _llamafactory(**keys)
    assert translation.refused() == []
    written = translation.config["train"]
    assert {k: written[k] for k in written if k in ("token_weighting", "eaft_alpha")} == train
    assert [k for k in keys if fates[k].fate == "ignored"] == ignored


def test_llamafactory_asft_is_refused_naming_dft():
    _, fates = _llamafactory(use_asft_loss=True)
    assert fates["use_asft_loss"].fate == "refused"
    assert "use_dft_loss is" in fates["use_asft_loss"].why


def test_a_translated_eaft_config_loads(tmp_path):
    translation, _ = _llamafactory(use_eaft_loss=True, eaft_alpha=0.5)
    translation.config["model"]["path"] = str(tmp_path)
    translation.config["data"] = {"datasets": [str(tmp_path / "d.jsonl")]}
    written = tmp_path / "keel.yaml"
    written.write_text(yaml.safe_dump(translation.config))
    cfg = load_config(written)
    assert (cfg.train.token_weighting, cfg.train.eaft_alpha) == ("eaft", 0.5)


def axolotl_eaft_loss(logits, targets, alpha: float, k: int) -> torch.Tensor:
    """Axolotl's EAFT sum over target tokens, as its loss function computes it."""
    keep = targets != -100
    with torch.no_grad():
        top = torch.topk(logits[keep].float(), k=k, dim=-1).values
        probs = F.softmax(top, dim=-1)
        weights = (-(probs * torch.log(probs + 1e-10)).sum(dim=-1)) ** alpha
    return (F.cross_entropy(logits[keep], targets[keep], reduction="none") * weights).sum()


@pytest.mark.parametrize(
    ("keys", "alpha", "k", "max_grad_norm"),
    [
        ({}, 1.0, 20, 1.0),  # their defaults
        ({"eaft_alpha": 2.0, "eaft_k": 10, "max_grad_norm": 0.5}, 2.0, 10, 0.5),
    ],
)
def test_axolotl_eaft_clips_where_theirs_does(keys, alpha, k, max_grad_norm):
    translation, fates = _axolotl(use_eaft=True, **keys)
    assert translation.refused() == []
    train = translation.config["train"]
    assert train["token_weighting"] == "eaft"
    scale = math.log(k) ** alpha
    assert train["max_grad_norm"] == pytest.approx(max_grad_norm / scale)
    assert train.get("eaft_alpha", 1.0) == alpha and train.get("eaft_top_k", 20) == k

    # their loss is keel's times `scale`: the gradients too, so clipping theirs at
    # max_grad_norm is clipping keel's at max_grad_norm / scale
    generator = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(9, 40, generator=generator), torch.randint(40, (9,))
    targets[0] = -100
    keel = weighted_cross_entropy_sums(logits, targets, TokenWeighting("eaft", alpha, k))[0]
    theirs = axolotl_eaft_loss(logits, targets, alpha, k)
    assert float(theirs) == pytest.approx(scale * float(keel), rel=1e-4)


def test_axolotl_eaft_settings_without_use_eaft_are_ignored():
    translation, fates = _axolotl(eaft_alpha=2.0, eaft_k=10, max_grad_norm=0.5)
    assert {fates[k].fate for k in ("eaft_alpha", "eaft_k")} == {"ignored"}
    assert translation.config["train"]["max_grad_norm"] == 0.5
    assert "token_weighting" not in translation.config["train"]


@pytest.mark.parametrize(
    ("keys", "fate", "evals_per_epoch"),
    [
        ({"evaluation_strategy": "no"}, "ignored", None),  # their EAFT example
        ({"eval_strategy": "epoch"}, "mapped", 1),
        ({"eval_strategy": "epoch", "eval_steps": 20}, "ignored", None),  # eval_steps first
        ({"eval_strategy": "best"}, "refused", None),
    ],
)
def test_axolotl_eval_strategy(keys, fate, evals_per_epoch):
    translation, fates = _axolotl(**keys)
    key = next(iter(keys))
    assert fates[key].fate == fate
    assert translation.config["train"].get("evals_per_epoch") == evals_per_epoch
