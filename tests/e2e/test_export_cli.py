"""`keel export` as users run it, and the result loaded by a process that imports neither
keel nor peft. The refused second export goes through keel.cli.main in the test process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from cli_support import keel_in_process

ROOT = Path(__file__).resolve().parents[2]

# Loads the folder with transformers alone, generates, and reports what got imported.
LOADER = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": "Who are you?"}],
    add_generation_prompt=True, return_tensors="pt", return_dict=True,
)
out = model.generate(**prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
print(json.dumps({
    "new_tokens": out.shape[1] - prompt["input_ids"].shape[1],
    "class": type(model).__name__,
    "imported": sorted(m for m in ("keel", "peft") if m in sys.modules),
}))
"""


def run(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_exported_folder_loads_without_keel_or_peft(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    adapter = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    adapter.save_pretrained(str(tmp_path / "adapter"))  # a PEFT folder made without keel
    out = tmp_path / "merged"
    flags = ["--model", str(tiny_model_dir), "--adapter", str(tmp_path / "adapter")]
    done = run("-m", "keel", "export", *flags, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "merged: max |logit diff|" in done.stdout
    loaded = run("-c", LOADER, str(out))
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    report = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert report == {"new_tokens": 3, "class": "LlamaForCausalLM", "imported": []}
    assert AutoTokenizer.from_pretrained(str(out)).chat_template  # the base's template, kept
    again = keel_in_process("export", *flags, "--out", str(out))
    assert again.returncode == 2 and "is not empty" in again.stderr
    assert "Traceback" not in again.stderr
