"""keel predict --nproc 2: each process answers every other row, with the seed of the row's
place in the whole dataset, so two processes write the file one process writes, sampled
answers included (an odd row count: the shares differ in size). Two srun tasks (no
torchrun: SLURM's variables alone) join as keel train's do and write the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cli_support import keel_in_process
from conftest import build_tiny_tokenizer
from multiproc import RUN_TIMEOUT_S, free_port
from serve_support import varied_tiny_model, write_model_dir

QUESTIONS = ["Who are you?", "Name a color.", "Add 2 and 3.", "Say hello.", "Give a tip."]


def test_two_processes_write_what_one_writes(tmp_path):
    tokenizer = build_tiny_tokenizer()
    model = write_model_dir(varied_tiny_model(len(tokenizer)), tokenizer, tmp_path / "model")
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Keel."}]}
        for q in QUESTIONS
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--model", str(model), "--data", "rows.jsonl", "--temperature", "1", "--seed", "3"]
    flags += ["--max-new-tokens", "12"]
    one = keel_in_process("predict", *flags, "--out", "one", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    command = [sys.executable, "-m", "keel", "predict", *flags, "--out", "two", "--nproc", "2"]
    two = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert two.returncode == 0, two.stderr[-4000:]
    assert "process r answers rows r, r + 2, r + 4, ..." in two.stdout
    srun = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"}
    srun |= {"MASTER_PORT": str(free_port()), "SLURM_JOB_ID": "1"}
    command = [sys.executable, "-m", "keel", "predict", *flags, "--out", "srun"]
    tasks = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env={**os.environ, **srun, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for task in tasks:
        _, err = task.communicate(timeout=RUN_TIMEOUT_S)
        assert task.returncode == 0, err[-4000:]

    def records(out: str) -> list[dict]:
        lines = (tmp_path / out / "generated_predictions.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    assert records("two") == records("one")
    assert records("srun") == records("one")
    assert len({r["predict"] for r in records("one")}) == len(QUESTIONS)  # sampled, varied
    results = json.loads((tmp_path / "two" / "predict_results.json").read_text())
    assert results["processes"] == 2 and results["predict_samples"] == len(QUESTIONS)
    assert not list(tmp_path.glob(".two.predict-progress-*"))  # each process's, once written
