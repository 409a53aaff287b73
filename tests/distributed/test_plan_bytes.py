"""`keel plan`'s params, grads and optimizer bytes equal what training allocates, exactly.

A random Llama with odd sizes (vocab 333, intermediate 101, ...) so that FSDP2's even
split pads the last rank's shards: the plan must count that padding.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plan_worker import CASES, HSDP_CASES, TP_CASES, measure, predicted, run_config

from keel.config import load_config
from keel.distributed.process_group import DistContext

WORKER = Path(__file__).with_name("plan_worker.py")


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=333,
        hidden_size=48,
        intermediate_size=101,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("odd-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def even_model_dir(tmp_path_factory) -> Path:
    """Odd sizes still (vocab 333, FSDP2 pads 51 rows of each half of the MLP over 2
    groups), but heads and MLP columns that split over 2 processes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=333, hidden_size=48, intermediate_size=102, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("even-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("method", ["full", "lora", "freeze", "lora+modules"])
def test_one_process_allocates_what_the_plan_says(odd_model_dir, method):
    cfg = load_config(None, base=run_config(odd_model_dir, "auto", method))
    got = measure(cfg, odd_model_dir, DistContext())
    want = predicted(cfg, odd_model_dir, "single", 1, 0)
    assert got == want["per_device"] == want["rank"]


def test_two_processes_allocate_what_the_plan_says(odd_model_dir, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            str(odd_model_dir),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for strategy, method in CASES:
        case = f"{strategy}-{method}"
        for rank, seen in enumerate(ranks):
            # Every rank holds exactly what the plan computes for it ...
            assert seen[case]["measured"] == seen[case]["rank"], (case, rank)
        # ... and the plan's per-device figure is the largest rank's (rank 0: FSDP2 gives
        # the last ranks the short or empty chunks).
        assert ranks[0][case]["measured"] == ranks[0][case]["per_device"], case
        assert ranks[1][case]["measured"] <= ranks[1][case]["per_device"], case
    # The odd sizes really did leave rank 1 with less optimizer state than rank 0.
    assert ranks[1]["fsdp-full"]["measured"][2] < ranks[0]["fsdp-full"]["measured"][2]


def test_hsdp_ranks_hold_their_groups_share(odd_model_dir, even_model_dir, tmp_path):
    """distributed.fsdp.shard_size 2 on 4 processes: two copies, each sharded over 2 of
    them; every rank holds what the plan computes for its place in its group. And
    distributed.tensor_parallel 2 on the same 4: each holds its half of the layers' share."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(WORKER), str(odd_model_dir), str(tmp_path), str(even_model_dir)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    for strategy, method in HSDP_CASES:
        case = f"{strategy}-{method}"
        for rank, seen in enumerate(ranks):
            assert seen[case]["measured"] == seen[case]["rank"], (case, rank)
        assert ranks[0][case]["measured"] == ranks[0][case]["per_device"], case
        # ranks 0 and 2 hold the same rows of the two copies, as do 1 and 3
        assert ranks[0][case]["measured"] == ranks[2][case]["measured"], case
        assert ranks[1][case]["measured"] == ranks[3][case]["measured"], case
    for strategy, method in TP_CASES:
        case = f"tp-{strategy}-{method}"
        for rank, seen in enumerate(ranks):
            assert seen[case]["measured"] == seen[case]["rank"], (case, rank)
        assert ranks[0][case]["measured"] == ranks[0][case]["per_device"], case
        # a group's two processes hold the same amounts (their halves of each layer)
        assert ranks[0][case]["measured"] == ranks[1][case]["measured"], case
    # sharded over 2, not 4: the moments of ranks 0 and 1 (unpadded shards) are one
    # process's, whole (each rank keeps its own 4-byte step per tensor)
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, base=run_config(odd_model_dir, "auto", "full"))
    whole = measure(cfg, odd_model_dir, DistContext())[2]
    steps = 4 * len(list(AutoModelForCausalLM.from_pretrained(odd_model_dir).parameters()))
    halves = ranks[0]["fsdp-full"]["measured"][2] + ranks[1]["fsdp-full"]["measured"][2]
    assert halves == whole + steps
