"""grpo on a vision-language model (a tiny Qwen2-VL), prompts with images: 2 processes, and
a context-parallel group of 2, sample the completions one process samples and train as it
does.

Each prompt's images are prefilled with it (alone: its image inputs and 3-D positions are
its own), then its completions decode as text. The rewards (functions of the text) must be
EQUAL, the losses and grad norms equal to fp32 round-off, the final weights close: under
DDP with a KL term (the reference is the policy with its adapters off, scoring with the
images), under FSDP2 with full training and a reused rollout (old log-probs with images),
and split over a context-parallel group (each process embeds the whole row, images
included, and keeps its part). The reward function checks the images it is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from multiproc import Workspace, case_runs
from test_grpo_parity import _assert_steps_match
from test_parity import assert_same_weights
from vlm_support import write_image, write_tiny_qwen2_vl_dir

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "grey": (90,) * 3}
# The prompt's images reach the reward (as TRL passes an image dataset's): each the colour
# its row names (the nearest of COLOURS to its top-left pixel), [] for a text prompt; a
# prompt of another row's images, or none, fails the run
REWARD = """
COLOURS = {colours!r}

def names_the_colour(prompts, completions, colour, images, **kwargs):
    for prompt, pictures, name in zip(prompts, images, colour):
        assert len(pictures) == prompt.count("<image>"), (prompt, pictures)
        if pictures:
            pixel = pictures[0].getpixel((0, 0))
            seen = min(COLOURS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLOURS[c], pixel)))
            assert seen == name, (seen, name)
    return [float(c in text) + text.count("e") / 10 for text, c in zip(completions, colour)]
"""


class VisionGrpoWorkspace(Workspace):
    def __init__(self, root: Path):
        super().__init__(root, write_tiny_qwen2_vl_dir(root / "qwen2_vl"))
        rows = []
        for index, (name, rgb) in enumerate(COLOURS.items()):
            images = [str(write_image(root / f"p{index}.png", seed=index, colour=rgb))]
            if index == 3:  # two images in one prompt; text prompts in the others' windows
                images.append(str(write_image(root / "extra.png", seed=9, size=(56, 84))))
            marks = "<image>" * len(images)
            rows.append({"prompt": f"{marks}What colour is it?", "images": images, "colour": name})
            rows.append({"prompt": f"Name a colour like {name}.", "colour": name})
        (root / "prompts.json").write_text(json.dumps(rows))
        (root / "rewards.py").write_text(REWARD.format(colours=COLOURS))
        cfg = yaml.safe_load(self.config.read_text())
        cfg["data"] = {"datasets": [str(root / "prompts.json")], "cutoff_len": 256}
        cfg["train"] |= {"stage": "grpo", "global_batch_size": 4, "max_steps": 4}
        cfg["grpo"] = {
            "rewards": ["rewards.py:names_the_colour"],
            "num_generations": 4,
            "max_completion_length": 6,
        }
        self.config.write_text(yaml.safe_dump(cfg))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> VisionGrpoWorkspace:
    return VisionGrpoWorkspace(tmp_path_factory.mktemp("grpo-vision"))


CASES = {
    "ddp-lora-kl": ("ddp", ("grpo.beta=0.1",)),
    "fsdp-full-reused": ("fsdp", ("method.type=full", "grpo.num_iterations=2")),
    "cp2-lora-dapo-ckpt": (
        "ddp",
        (
            "distributed.context_parallel=2",
            "grpo.loss_type=dapo",
            "train.gradient_checkpointing=true",
        ),
    ),
}


@pytest.fixture(scope="module")
def two_processes(workspace) -> dict[str, Path]:
    return workspace.train_together(case_runs(CASES))


@pytest.fixture(scope="module")
def one_process(workspace):
    """The 1-process run of each case (by case), made once for the module's tests."""
    runs: dict[str, Path] = {}

    def run(case: str) -> Path:
        if case not in runs:
            overrides = (o for o in CASES[case][1] if not o.startswith("distributed."))
            runs[case] = workspace.train(f"{case}-one", *overrides)
        return runs[case]

    return run


@pytest.mark.parametrize("case", CASES)
def test_two_processes_sample_and_train_like_one(two_processes, one_process, case):
    _assert_same_run(two_processes[case], one_process(case))


def test_a_checkpoint_inside_a_rollout_with_images_resumes_it(workspace, one_process):
    """Stopped after step 3, inside the second rollout's 2 steps: the checkpoint holds the
    rollout's rows (their images found again from their prompts: prepared data is not
    JSON), and the resumed step 4 trains on them as the unbroken run does."""
    overrides = CASES["fsdp-full-reused"][1]
    workspace.train("reused-resumed", *overrides, "train.max_steps=3")
    resumed = workspace.train("reused-resumed", *overrides)
    assert "resumed from" in workspace.last_output
    _assert_same_run(resumed, one_process("fsdp-full-reused"))


def _assert_same_run(got: Path, want: Path) -> None:
    """Equal rewards and lengths, losses and grad norms to round-off, close weights."""
    _assert_steps_match(got, want)
    assert_same_weights(got, want)
