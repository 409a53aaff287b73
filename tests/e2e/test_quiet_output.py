"""What the CLI prints into a pipe or log file: plain lines, no library progress bars, and
the technical set-up lines only with --verbose."""

from cli_support import keel, keel_in_process

LIBRARY_BARS = ("Generating train split", "Loading weights", "Writing model shards")


def train(model_dir, tmp_path, name, *flags, run=keel):
    """A 2-step train of the quickstart's config: `run` keel (its own process, its output
    into a pipe) or keel_in_process."""
    return run(
        *flags,
        "train",
        "examples/identity_lora.yaml",
        f"model.path={model_dir}",
        f"model.cache_dir={tmp_path / name / 'cache'}",
        f"output.dir={tmp_path / name / 'out'}",
        "train.max_steps=2",
        "train.precision=fp32",
        "train.threads=1",
    )


def test_piped_train_prints_plain_lines_and_no_library_bars(tiny_model_dir, tmp_path):
    result = train(tiny_model_dir, tmp_path, "quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "\r" not in printed
    assert not [bar for bar in LIBRARY_BARS if bar in printed], printed
    assert "loss head:" not in printed and "threads: " not in printed
    assert "steps: train.max_steps=2 overrides train.epochs=3" in result.stdout
    assert "step 2/2: loss " in result.stdout
    (done,) = [line for line in result.stdout.splitlines() if line.startswith("done: ")]
    loss = done.split("final loss ")[1].split(",")[0]
    assert len(loss.split(".")[1]) == 4, done  # 4 decimals, not 16 digits

    # the set-up lines --verbose adds (a flag of keel's own: checked in this process)
    verbose = train(tiny_model_dir, tmp_path, "verbose", "--verbose", run=keel_in_process)
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "loss head: " in verbose.stdout and "threads: 1 per process" in verbose.stdout


def test_piped_chat_shows_no_loading_bar(tiny_model_dir, tmp_path):
    result = keel(
        "chat",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Loading weights" not in result.stderr and "\r" not in result.stderr


def test_validate_reports_steps_and_epochs(tiny_model_dir, tmp_path):
    result = keel_in_process(
        "validate",
        "examples/identity_lora.yaml",
        f"model.path={tiny_model_dir}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"output.dir={tmp_path / 'out'}",
        "train.max_steps=12",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (steps,) = [line for line in result.stdout.splitlines() if line.startswith("steps:")]
    assert "train.max_steps=12 overrides train.epochs=3: 12 steps = 1.33 epochs" in steps
