"""train.router_aux_loss_coef: a mixture of experts' load-balancing loss, as transformers
adds it with output_router_logits (its own load_balancing_loss_func, padding masked out),
on keel's summed loss, right-padded or padding-free."""

import pytest
import torch
import torch.nn.functional as F

from keel.config.schema import DataConfig, ModelConfig, OutputConfig, RunConfig
from keel.data import collate
from keel.distributed.process_group import DistContext
from keel.errors import ModelError
from keel.precision import Precision
from keel.train.model_setup import build_training_model

COEF = 0.1
# (input_ids, pre-shifted targets): three samples of different lengths
SAMPLES = [
    ([5, 9, 14, 3, 22, 7, 8], [-100, -100, 3, 22, 7, 8, 2]),
    ([5, 11, 6], [-100, 6, 2]),
    ([5, 30, 31, 32, 33], [-100, -100, 32, 33, 2]),
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, router_aux_loss_coef=0.001,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def build(path, coef, padding_free: bool, token_weighting: str = "none"):
    cfg = RunConfig(
        model=ModelConfig(path=str(path)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(path / "out")),
    )
    cfg.train.router_aux_loss_coef = coef
    cfg.train.token_weighting = token_weighting
    cfg.train.padding_free = padding_free
    built = build_training_model(cfg, path, DistContext(), Precision("fp32", "test"), print)
    return built.objective.train()


def hugging_face_loss(path, coef: float) -> float:
    """Mean cross-entropy over the samples' targets + coef x the aux loss of one padded
    forward with its attention mask, as transformers' MoE forward adds it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    width = max(len(ids) for ids, _ in SAMPLES)
    ids = torch.zeros(len(SAMPLES), width, dtype=torch.long)
    targets = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, (tokens, target) in enumerate(SAMPLES):
        ids[row, : len(tokens)], targets[row, : len(tokens)] = (
            torch.tensor(tokens),
            torch.tensor(target),
        )
        mask[row, : len(tokens)] = 1
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return float(ce + coef * out.aux_loss)


def keel_loss(objective, padding_free: bool) -> tuple[float, float]:
    rows = [
        {"input_ids": ids, "targets": t, "position_ids": list(range(len(ids)))}
        for ids, t in SAMPLES
    ]
    out = objective(collate(rows, pad_id=0, padding_free=padding_free))
    loss, statistics = out.loss.detach(), out.statistics
    return float(loss / out.count), float(statistics[0] / statistics[1])


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_balance_term_is_transformers_own(moe_dir, padding_free):
    objective = build(moe_dir, COEF, padding_free)
    got, aux = keel_loss(objective, padding_free)
    want = hugging_face_loss(moe_dir, COEF)
    assert got == pytest.approx(want, rel=1e-5)
    without = hugging_face_loss(moe_dir, 0.0)
    assert abs(want - without) > 1e3 * 1e-5 * want  # the term is there to be seen
    assert COEF * aux == pytest.approx(want - without, rel=1e-4)


def test_model_takes_the_config_coefficient_and_eval_leaves_it_out(moe_dir):
    objective = build(moe_dir, "model", padding_free=True)
    assert objective.terms.router_balance.coefficient == 0.001
    got, _ = keel_loss(objective, True)
    assert got == pytest.approx(hugging_face_loss(moe_dir, 0.001), rel=1e-5)
    objective.eval()
    with torch.no_grad():
        assert keel_loss(objective, True)[0] == pytest.approx(
            hugging_face_loss(moe_dir, 0.0), rel=1e-5
        )


def test_with_token_weighting_the_terms_add_up_and_both_are_logged(moe_dir):
    weighted = build(moe_dir, 0.0, True, token_weighting="dft")
    both = build(moe_dir, COEF, True, token_weighting="dft")
    assert both.metric_names == ("ce_loss", "aux_loss")
    rows = [
        {"input_ids": ids, "targets": t, "position_ids": list(range(len(ids)))}
        for ids, t in SAMPLES
    ]
    batch = collate(rows, pad_id=0, padding_free=True)
    alone, out = weighted(batch), both(batch)
    ce_sum, tokens, aux, counted = out.statistics.tolist()
    assert (tokens, counted) == (float(out.count), 1.0)
    assert ce_sum == pytest.approx(float(alone.statistics[0]), rel=1e-6)
    assert ce_sum > 2 * float(alone.loss)  # the weighted loss is not the plain one
    want = alone.loss + COEF * aux * out.count
    assert float(out.loss) == pytest.approx(float(want), rel=1e-6)


def test_a_model_without_routers_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ModelError, match="has no router whose load-balancing loss"):
        build(tiny_model_dir, 0.01, padding_free=True)


@pytest.mark.parametrize(
    ("stage", "setting", "problem"),
    [
        (
            "dpo",
            0.01,
            "adds the routers' balance to a next-token loss (stage pt or sft), not to dpo",
        ),
        ("kto", "model", "not to kto's"),
        ("sft", -0.5, "= -0.5 must be a number >= 0, or model"),
        ("sft", True, "= True must be a number >= 0, or model"),
    ],
)
def test_the_setting_is_checked_before_anything_loads(stage, setting, problem, tmp_path):
    from keel.config.validate import check_config

    cfg = RunConfig(
        model=ModelConfig(path=str(tmp_path)),
        data=DataConfig(datasets=[]),
        output=OutputConfig(dir=str(tmp_path / "out")),
    )
    cfg.train.stage, cfg.train.router_aux_loss_coef = stage, setting
    assert any(problem in p for p in check_config(cfg)), check_config(cfg)
