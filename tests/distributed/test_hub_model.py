"""A Hub model.path in a 2-process run: fetched once per node on the slow group, offline."""

import subprocess
import sys

import yaml
from hub_support import COMMIT, add_snapshot, offline_env
from multiproc import RUN_TIMEOUT_S, Workspace

REPO = "tiny-org/tiny-llama"


def test_two_processes_train_a_hub_model(tmp_path, tiny_model_dir):
    hf_home = tmp_path / "hf"
    add_snapshot(hf_home / "hub", REPO, tiny_model_dir)
    workspace = Workspace(tmp_path, tiny_model_dir)
    cfg = yaml.safe_load(workspace.config.read_text())
    cfg["model"]["path"] = REPO
    workspace.config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "keel", "train", str(workspace.config), f"output.dir={out}"]
    args += ["train.max_steps=2", "--nproc", "2"]
    env = offline_env(hf_home)
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run(
        args, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"model {REPO} at commit {COMMIT}" in done.stdout + done.stderr
    assert (out / "adapter_config.json").is_file()
