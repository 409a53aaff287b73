"""Record the losses of keel's shipped examples and parity cases; compare two records.

A refactor must not change a number. Record before moving code, record after, compare on
the same machine: every value must be bit-identical.

    python tools/loss_compare.py record before.json                # every case
    python tools/loss_compare.py record after.json --only dpo      # cases whose name has "dpo"
    python tools/loss_compare.py record old.json --repo ../old-checkout
    python tools/loss_compare.py compare before.json after.json    # exit 1 on any difference
    python tools/loss_compare.py list

Each case runs the real CLI (`python -m keel train`) of the checkout named by --repo (its
`src` first on PYTHONPATH) in fp32 with fixed threads, and reads metrics.jsonl. The tiny-model
cases are the parity tests' configurations (one process and two, DDP and FSDP, LoRA, full,
QLoRA, packing, gradient checkpointing, every preference stage, rm, grpo, resume); the
example cases are every `examples/*.yaml`, cut to a few steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent.parent
EXAMPLE_STEPS = 2
TINY_STEPS = 6

# values that are numbers of the training, not of the machine's speed
_EXACT = ("loss", "grad_norm", "lr", "kl", "nll_loss", "pairs", "samples")
_EXACT += ("accuracy", "margin", "mean_reward", "chosen_reward", "rejected_reward")  # rm
_EXACT += ("reward", "reward_std", "frac_reward_zero_std")  # grpo
_EXACT_PREFIXES = ("eval_", "rewards/", "logps/", "log_odds", "completions/", "clip_ratio/")

PAIRS = [
    ("Who are you?", "I am Keel, a small assistant.", "I am a cat."),
    ("What is your name?", "My name is Keel.", "Bob, maybe."),
    ("Add 2 and 3.", "5", "23"),
    ("Say hello in French.", "Bonjour.", "Hello."),
    ("Give a healthy tip.", "Sleep enough and move every day.", "Eat sugar."),
    ("Name a color.", "Blue.", "A number."),
    ("What is 3 times 4?", "12", "34"),
    ("Are you ChatGPT?", "No, I am Keel.", "Yes."),
    ("Count to three.", "1, 2, 3.", "3"),
    ("What comes after Monday?", "Tuesday.", "Sunday, then Friday."),
    ("Is the sky blue?", "Yes, on a clear day.", "Never."),
    ("Translate to French: hello world.", "Bonjour le monde.", "Hola mundo."),
]
# grpo: the prompts of the pairs, rewarded by the share of one letter in the completion
# (a function of the sampled text: equal on any number of processes)
GRPO_REWARDS = """
def share_of_letter(completions, letter, **kwargs):
    return [text.count(x) / max(len(text), 1) for text, x in zip(completions, letter)]
"""
# imported by module name (the workspace is on PYTHONPATH), so the run's config, recorded
# with its numbers, names no temporary folder
GRPO_REWARDS_MODULE = "loss_compare_rewards"
GRPO = {
    "rewards": [f"{GRPO_REWARDS_MODULE}:share_of_letter"],
    "num_generations": 4,
    "max_completion_length": 6,
}


@dataclass(frozen=True)
class Case:
    """One `keel train` run (or two, for resume): a config, overrides, process count."""

    name: str
    config: str  # "tiny-sft", "tiny-pairs", "tiny-kto", "tiny-prompts" or an examples/ file name
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    resume_from_steps: int = 0  # >0: run that many steps first, then resume to the end


@dataclass
class Workspace:
    repo: Path
    root: Path
    configs: dict[str, Path] = field(default_factory=dict)


PARITY = [
    ("lora", ()),
    ("full", ("method.type=full",)),
    ("full-packed-ckpt", ("method.type=full", "data.packing=true", "train.gradient_checkpointing=true")),
    ("lora-packed-ckpt-merged", ("data.packing=true", "train.gradient_checkpointing=true", "output.merge_lora=true")),
    ("qlora", ("method.type=qlora",)),
    ("qlora-packed-ckpt", ("method.type=qlora", "data.packing=true", "train.gradient_checkpointing=true")),
]  # fmt: skip
PREFERENCE = [
    ("dpo-packed", "tiny-pairs", ("train.stage=dpo", "data.packing=true")),
    ("dpo-ckpt", "tiny-pairs", ("train.stage=dpo", "train.gradient_checkpointing=true")),
    ("orpo-full", "tiny-pairs", ("train.stage=orpo", "method.type=full")),
    ("simpo-packed", "tiny-pairs", ("train.stage=simpo", "data.packing=true")),
    ("kto-freeze", "tiny-kto", ("train.stage=kto", "method.type=freeze", "method.freeze.trainable_layers=1")),
    ("rm-lora", "tiny-pairs", ("train.stage=rm", "rm.center_rewards_coefficient=0.01")),
    ("rm-full", "tiny-pairs", ("train.stage=rm", "method.type=full")),
    ("grpo-full", "tiny-prompts", ("method.type=full",)),
    ("grpo-dapo-reused", "tiny-prompts", ("grpo.loss_type=dapo", "grpo.num_iterations=2", "output.save_every=2")),
]  # fmt: skip


def all_cases(repo: Path) -> list[Case]:
    cases = []
    for name, overrides in PARITY:
        cases.append(Case(f"sft-{name}-one", "tiny-sft", overrides))
        for strategy in ("ddp", "fsdp"):
            if strategy == "ddp" and "merged" in name:
                continue
            extra = (*overrides, f"distributed.strategy={strategy}")
            cases.append(Case(f"sft-{name}-{strategy}", "tiny-sft", extra, nproc=2))
    for name, config, overrides in PREFERENCE:
        cases.append(Case(f"{name}-one", config, overrides))
        cases.append(Case(f"{name}-fsdp", config, (*overrides, "distributed.strategy=fsdp"), 2))
    cases.append(Case("sft-lora-resumed", "tiny-sft", (), resume_from_steps=3))
    cases.append(Case("sft-full-fsdp-resumed", "tiny-sft", PARITY[1][1], 2, resume_from_steps=3))
    cases.append(Case("dpo-resumed", "tiny-pairs", ("train.stage=dpo",), resume_from_steps=3))
    for example in sorted((repo / "examples").glob("*.yaml")):
        nproc = 2 if "fsdp" in example.stem else 1
        cases.append(Case(f"example-{example.stem}", example.name, nproc=nproc))
    return cases


def _tiny_config(ws: Workspace, data: Path) -> dict:
    return {
        "model": {"path": str(ws.root / "tiny-model"), "cache_dir": str(ws.root / "cache")},
        "method": {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "data": {"datasets": [str(data)], "cutoff_len": 128, "val_size": 1},
        "train": {
            "max_steps": TINY_STEPS,
            "micro_batch_size": 2,
            "global_batch_size": 5,
            "lr": 1e-2,
            "scheduler": "constant",
            "precision": "fp32",
            "threads": 1,
        },
        "output": {"dir": "unused", "save_every": 3, "keep_last": 3},
    }


def prepare(ws: Workspace) -> None:
    """The tiny model (the tests' seeded builder), the datasets and the tiny configs."""
    sys.path.insert(0, str(ws.repo / "tests"))
    from conftest import QA, write_tiny_model_dir  # noqa: PLC0415 (tests' own builder)

    write_tiny_model_dir(ws.root / "tiny-model")
    files = {
        "tiny-sft": [{"instruction": q, "input": "", "output": a} for q, a in (QA * 2)[:12]],
        "tiny-pairs": [{"prompt": q, "chosen": c, "rejected": r} for q, c, r in PAIRS],
        "tiny-kto": [
            {"prompt": q, "completion": r if i % 3 else c, "label": not i % 3}
            for i, (q, c, r) in enumerate(PAIRS)
        ],
    }
    files["tiny-prompts"] = [{"prompt": q, "letter": "a"} for q, _c, _r in PAIRS[:8]]
    (ws.root / f"{GRPO_REWARDS_MODULE}.py").write_text(GRPO_REWARDS)
    for name, rows in files.items():
        data = ws.root / f"{name}.json"
        data.write_text(json.dumps(rows))
        config = _tiny_config(ws, data)
        if name == "tiny-prompts":  # batch sizes count prompts; no held-out prompts
            config["data"].pop("val_size")
            config["train"] |= {"stage": "grpo", "global_batch_size": 4}
            config["grpo"] = GRPO
        ws.configs[name] = ws.root / f"{name}.yaml"
        ws.configs[name].write_text(yaml.safe_dump(config))


def _command(ws: Workspace, case: Case, out: Path, steps: int | None) -> list[str]:
    if case.config in ws.configs:
        config = ws.configs[case.config]
        overrides = [*case.overrides]
        if steps is not None:
            overrides.append(f"train.max_steps={steps}")
    else:
        config = ws.repo / "examples" / case.config
        # a short cutoff keeps each example's path (model, format, stage) at a fraction of the cost
        overrides = [f"train.max_steps={steps or EXAMPLE_STEPS}", "train.precision=fp32"]
        overrides += ["train.threads=2", "output.save_every=0", "data.cutoff_len=128"]
        overrides += case.overrides
    args = [sys.executable, "-m", "keel", "train", str(config), f"output.dir={out}", *overrides]
    return args + (["--nproc", str(case.nproc)] if case.nproc > 1 else [])


def run_case(ws: Workspace, case: Case) -> dict[str, dict[str, float]]:
    """step -> {metric: value} for one case (a resumed case: the resumed run's file)."""
    out = ws.root / "runs" / case.name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ws.repo / "src"), str(ws.root)])}
    env.pop("OMP_NUM_THREADS", None)
    runs = [case.resume_from_steps, None] if case.resume_from_steps else [None]
    for steps in runs:
        done = subprocess.run(
            _command(ws, case, out, steps),
            cwd=ws.repo,  # examples name their data relative to the repository
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{case.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return read_metrics(out / "metrics.jsonl")


def read_metrics(path: Path) -> dict[str, dict[str, float]]:
    steps: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        kept = {
            key: value
            for key, value in record.items()
            if key in _EXACT or key.startswith(_EXACT_PREFIXES)
        }
        steps.setdefault(str(record["step"]), {}).update(kept)
    return steps


def record(target: Path, repo: Path, only: str | None, exclude: str | None) -> int:
    cases = [
        c
        for c in all_cases(repo)
        if (not only or only in c.name) and not (exclude and exclude in c.name)
    ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="keel-loss-compare-") as tmp:
        ws = Workspace(repo=repo, root=Path(tmp))
        prepare(ws)
        for case in cases:
            began = time.perf_counter()
            results[case.name] = run_case(ws, case)
            print(
                f"{case.name}: {len(results[case.name])} steps, {time.perf_counter() - began:.0f} s"
            )
            # written after every case: a long record is usable while it runs
            target.write_text(json.dumps({"cases": results}, indent=1, sort_keys=True))
    print(f"wrote {len(results)} cases to {target}")
    return 0


def compare(before: Path, after: Path) -> int:
    """Every value of every case present in both must be identical; exit 1 if not."""
    old = json.loads(before.read_text())["cases"]
    new = json.loads(after.read_text())["cases"]
    differences, compared = [], 0
    for name in sorted(old.keys() & new.keys()):
        if old[name].keys() != new[name].keys():
            differences.append(f"{name}: steps {sorted(old[name])} -> {sorted(new[name])}")
            continue
        for step, values in old[name].items():
            for key, value in values.items():
                compared += 1
                if new[name][step].get(key) != value:
                    got = new[name][step].get(key)
                    differences.append(f"{name} step {step} {key}: {value!r} -> {got!r}")
    missing = sorted(old.keys() ^ new.keys())
    print(f"{len(old.keys() & new.keys())} cases, {compared} values compared")
    if missing:
        print("in only one record: " + ", ".join(missing))
    for line in differences:
        print("DIFFERENT " + line)
    print("bit-identical" if not differences else f"{len(differences)} differences")
    return 1 if differences else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the cases and write their numbers")
    rec.add_argument("target", type=Path)
    rec.add_argument("--repo", type=Path, default=HERE, help="the keel checkout to run")
    rec.add_argument("--only", help="run only cases whose name contains this")
    rec.add_argument("--exclude", help="leave out cases whose name contains this")
    cmp_ = sub.add_parser("compare", help="compare two records; exit 1 on any difference")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    lst = sub.add_parser("list", help="name every case")
    lst.add_argument("--repo", type=Path, default=HERE)
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.target.resolve(), args.repo.resolve(), args.only, args.exclude)
    if args.command == "compare":
        return compare(args.before, args.after)
    for case in all_cases(args.repo.resolve()):
        print(case.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
