"""`keel train` with train.stage rm on the tiny model: metrics, an output folder that
AutoModelForSequenceClassification loads with keel's scores, and an exact resume.

The runs go through keel.cli.main in this process (cli_support.keel_in_process)."""

import json

import pytest
import torch
import yaml
from cli_support import keel_in_process
from config_support import tiny_lora_config

from keel.data import collate
from keel.stages.registry import get_stage
from keel.stages.rm import RmSettings
from keel.train.reward_objective import RewardObjective, last_positions

PAIRS = [
    {
        "prompt": f"{i}+{i}?",
        "chosen": f"{2 * i}!",
        "rejected": "No.",
        "margin": 0.5 * (i % 3),
    }
    for i in range(8)
]
NO_SPECIALS = {"return_tensors": "pt", "add_special_tokens": False}  # as TRL scores texts


@pytest.fixture
def rm_config(tmp_path, tiny_model_dir):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))

    def write(name: str, method: str = "lora") -> tuple:
        out = tmp_path / name
        train = {"stage": "rm", "max_steps": 4, "scheduler": "constant", "seed": 3}
        config = tiny_lora_config(tiny_model_dir, data, out, cutoff_len=256, train=train)
        config["rm"] = {"center_rewards_coefficient": 0.01}
        if method != "lora":
            config["method"] = {"type": method}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path, out

    return write


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_an_rm_run_exports_a_sequence_classifier_with_keel_s_scores(
    rm_config, tiny_tokenizer, method
):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config, out = rm_config(f"run-{method}", method)
    result = keel_in_process("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert {"accuracy", "margin", "mean_reward", "pairs"} <= steps[0].keys()

    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"]
    assert saved["pad_token_id"] == tiny_tokenizer.pad_token_id
    assert not (out / "adapter_config.json").exists() and not (out / "causal_lm").exists()
    classifier = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert classifier.config.num_labels == 1

    # keel's objective on the same backbone and head scores what the classifier scores
    backbone = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    objective = RewardObjective(backbone, stage=get_stage("rm"), settings=RmSettings(), seed=0)
    objective.score.weight.data.copy_(classifier.score.weight.data)
    rows = _prepared_rows(tiny_tokenizer, out.parent)
    batch = collate(rows, tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        keel_scores = objective.scores(batch)  # [S]
        ends = last_positions(batch)  # each whole sequence, as the classifier reads it
        flat = batch["input_ids"].reshape(-1)
        starts = (batch["position_ids"].reshape(-1) == 0).nonzero().squeeze(-1)
        sequence_starts = starts[torch.searchsorted(starts, ends, right=True) - 1]
        hf_scores = torch.stack(
            [
                classifier(input_ids=flat[a : b + 1][None]).logits[0, 0]
                for a, b in zip(sequence_starts.tolist(), ends.tolist())
            ]
        )
    torch.testing.assert_close(keel_scores, hf_scores, rtol=1e-5, atol=1e-5)


def test_an_interrupted_rm_run_resumes_exactly(rm_config, tmp_path, monkeypatch):
    config, out = rm_config("interrupted")
    monkeypatch.setenv("KEEL_FAULT", "oom:3")  # dies in step 3; step 2 is checkpointed
    stopped = keel_in_process("train", str(config))
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    monkeypatch.delenv("KEEL_FAULT")
    resumed = keel_in_process("train", str(config))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    clean_config, clean = rm_config("clean")
    assert keel_in_process("train", str(clean_config)).returncode == 0
    got, want = losses(out), losses(clean)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6)
    from safetensors.torch import load_file

    head = load_file(out / "model.safetensors")["score.weight"]
    torch.testing.assert_close(head, load_file(clean / "model.safetensors")["score.weight"])


def _prepared_rows(tokenizer, base_dir) -> list[dict]:
    from keel.config.schema import DataConfig, DatasetConfig
    from keel.data import prepare_data

    data = prepare_data(
        DataConfig(datasets=[DatasetConfig(path="pairs.jsonl")], cutoff_len=256),
        tokenizer,
        stage="rm",
        cache_dir=base_dir / "check-cache",
        base_dir=base_dir,
        seed=0,
        log=lambda _line: None,
    )
    return [data.train[i] for i in range(4)]


def test_a_trained_reward_model_is_a_grpo_reward(rm_config, tiny_model_dir, tmp_path):
    """The rm run's folder named in grpo.rewards: every completion of the grpo run is scored
    by it, and the scores in completions.jsonl are what the exported classifier gives the
    prompt + completion text on its own (no padding), under the folder's name."""
    from test_grpo_cli import train as train_grpo
    from test_grpo_cli import write_run
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    config, rm_dir = rm_config("rm-for-grpo")
    assert keel_in_process("train", str(config)).returncode == 0
    run = write_run(tmp_path / "grpo", tiny_model_dir, steps=2, every=1)
    records = train_grpo(run, f"grpo.rewards=[{rm_dir}]")
    assert [r["step"] for r in records] == [1, 2]
    assert "rewards/rm-for-grpo/mean" in records[0]
    samples = [json.loads(line) for line in (run / "out" / "completions.jsonl").open()]
    assert len(samples) == 2 * 4 * 8  # 2 steps x 4 prompts x 8 completions

    classifier = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(rm_dir))
    with torch.no_grad():
        own = [
            classifier(**tokenizer(s["prompt"] + s["completion"], **NO_SPECIALS))
            .logits[0, 0]
            .item()
            for s in samples
        ]
    scored = [s["rewards"]["rm-for-grpo"] for s in samples]
    torch.testing.assert_close(torch.tensor(scored), torch.tensor(own), rtol=1e-5, atol=1e-5)
    assert len(set(scored)) > 1  # completions of different text score differently


def test_a_model_rm_cannot_write_is_refused_before_training(tmp_path):
    """A vision-language model (whose sequence-classification folder transformers cannot
    build) is refused before any training, with exit 2 and nothing written; before this
    check the run trained and then failed writing its output with a traceback."""
    from vlm_support import write_tiny_qwen2_vl_dir

    model = write_tiny_qwen2_vl_dir(tmp_path / "qwen2_vl")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    config = tiny_lora_config(model, data, tmp_path / "out", train={"stage": "rm"})
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(config))
    done = keel_in_process("train", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert "train.stage = rm trains text reward models" in done.stderr
    assert "qwen2_vl is a vision-language model" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_which_models_rm_can_write():
    from transformers import AutoConfig, GraniteConfig, LlamaConfig, OlmoeConfig
    from vlm_support import build_qwen2_vl_tokenizer, qwen2_vl_config

    from keel.models.sequence_classifier import sequence_classifier_problem

    assert sequence_classifier_problem(LlamaConfig()) is None
    assert sequence_classifier_problem(AutoConfig.for_model("qwen3_moe")) is None
    for config in (GraniteConfig(), OlmoeConfig()):
        assert "transformers has none for" in sequence_classifier_problem(config)
    remote = GraniteConfig()
    remote.auto_map = {"AutoModelForSequenceClassification": "modeling.GraniteScorer"}
    assert sequence_classifier_problem(remote) is None  # the model's own code has one
    vlm = qwen2_vl_config(build_qwen2_vl_tokenizer())
    assert "is a vision-language model" in sequence_classifier_problem(vlm)
