"""Per-process peak memory of DDP vs FSDP2 training on CPU, on a ~0.4B-parameter model.

Why: under DDP every process holds a full replica (fp32 weights + gradients + two AdamW
moments = 16 bytes per trainable parameter); under FSDP each of N processes should hold
about 1/N of it, because keel builds the model on the meta device, shards it, allocates
only local shards and reads only its rows of each safetensors tensor. This measures that.

A randomly initialised Llama-architecture model (fp32 safetensors, SmolLM2 tokenizer) is
built once into --work-dir. Then, one run at a time (RAM), `keel train --nproc 2` runs
2 steps for each strategy x method, plus a one-process full fine-tune as the baseline of
one full replica. Each run's keel_run.json gives every rank's peak RSS right after the
model is loaded (load peak) and at the end of the run (training peak). While a run goes,
/proc/<pid>/status of each worker is also sampled, to split its RSS into anonymous memory
(tensors) and file-backed pages (e.g. mmap'd safetensors), which RSS counts too.

    python benchmarks/fsdp_memory.py [--methods full,lora] [--strategies ddp,fsdp]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

ARCH = dict(
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=10,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=49152,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
)
STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def build_model(model_dir: Path) -> None:
    """Random Llama weights, fp32, saved with save_pretrained; runs in its own process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from keel.models import load_tokenizer, resolve_model_path

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**ARCH)).to(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(model_dir))
    tok_dir = resolve_model_path("bundled:smollm2-135m-instruct", "~/.cache/keel", log=print)
    load_tokenizer(tok_dir).save_pretrained(str(model_dir))
    (model_dir.parent / "model_info.json").write_text(
        json.dumps({"params": n_params, "arch": ARCH})
    )


def ensure_model(work: Path) -> dict:
    info = work / "model_info.json"
    if not info.is_file():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--build", str(work / "model")], check=True)
    return json.loads(info.read_text())


def make_dataset(path: Path, rows: int = 16) -> None:
    topics = ["rivers", "compilers", "bread", "volcanoes", "chess", "tides", "bees", "glass"]
    data = [
        {
            "instruction": f"Write two sentences about {topics[i % len(topics)]} (#{i}).",
            "output": f"{topics[i % len(topics)].capitalize()} are interesting. "
            f"This is example number {i} of a tiny benchmark dataset.",
        }
        for i in range(rows)
    ]
    path.write_text(json.dumps(data, indent=1))


def write_config(work: Path, strategy: str, method: str, name: str) -> Path:
    cfg = {
        "model": {"path": str(work / "model"), "cache_dir": str(work / "cache")},
        "method": {"type": method, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "data": {
            "datasets": [{"path": str(work / "data.json"), "format": "alpaca"}],
            "cutoff_len": 128,
        },
        "train": {
            "max_steps": 2,
            "micro_batch_size": 1,
            "global_batch_size": 2,
            "precision": "fp32",
            "resume": "never",
        },
        "output": {"dir": str(work / f"out-{name}"), "overwrite": True},
        "distributed": {"strategy": strategy},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class RssSampler:
    """Polls /proc/<pid>/status of a process tree's keel workers; keeps each field's max.

    Sampling misses short spikes, so these maxima sit below the kernel's peak RSS; they say
    how much of a process's memory is anonymous (tensors) and how much file-backed.
    """

    def __init__(self, root_pid: int, interval: float = 0.25):
        self.root, self.interval = root_pid, interval
        self.peaks: dict[str, dict[str, int]] = {}  # rank -> field -> max kB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for proc in procs:
                self._sample(proc)
            self._stop.wait(self.interval)

    def _sample(self, proc: psutil.Process) -> None:
        try:
            cmd = " ".join(proc.cmdline())
            if "keel" not in cmd or "torch.distributed.run" in cmd:
                return
            env = proc.environ()
            if "RANK" not in env and "--nproc" in cmd:
                return  # the launcher, not a worker
            rank = env.get("RANK", "0")
            status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        except (psutil.Error, OSError):
            return
        peak = self.peaks.setdefault(rank, {})
        for line in status:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                peak[key] = max(peak.get(key, 0), int(value.split()[0]))

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join()
        return {r: {k: round(v / 1024, 1) for k, v in p.items()} for r, p in self.peaks.items()}


def run_one(work: Path, strategy: str, method: str, nproc: int) -> dict:
    name = f"{strategy}-{method}" if nproc > 1 else f"single-{method}"
    cfg = write_config(work, strategy, method, name)
    cmd = [sys.executable, "-m", "keel", "train", str(cfg)]
    cmd += ["--nproc", str(nproc)] if nproc > 1 else []
    start = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        sampler = RssSampler(proc.pid)
        try:
            rc = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    sampled = sampler.stop()
    wall = time.perf_counter() - start
    summary_path = work / f"out-{name}" / "keel_run.json"
    if rc or not summary_path.is_file():
        tail = (work / f"{name}.log").read_text()[-3000:]
        print(f"{name} FAILED (rc {rc}) after {wall:.0f}s:\n{tail}", flush=True)
        return {
            "name": name,
            "strategy": strategy if nproc > 1 else "none",
            "method": method,
            "failed": True,
            "wall_s": round(wall, 1),
        }
    summary = json.loads(summary_path.read_text())
    result = {
        "name": name,
        "strategy": strategy if nproc > 1 else "none",
        "method": method,
        "processes": summary["processes"],
        "per_rank": summary["per_rank"],
        "tokens_per_s": summary["tokens_per_s"],
        "wall_s": round(wall, 1),
        "sampled_mb": dict(sorted(sampled.items())),
    }
    print(f"{name}: {wall:.0f}s, per rank {summary['per_rank']}, sampled {sampled}", flush=True)
    return result


def _ranks(result: dict, key: str) -> list[str]:
    values = [f"{r[key]:.0f}" for r in result["per_rank"]]
    return values + ["-"] * (2 - len(values))


def table(results: list[dict], params: int) -> str:
    lines = [
        f"Llama, {params / 1e9:.3f} B params, fp32, 2 steps x 2 rows x <= 128 tokens, "
        f"CPU (gloo); RSS in MB",
        "",
        "| strategy | method | processes | load peak r0 | load peak r1 | train peak r0 "
        "| train peak r1 | tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ok = [r for r in results if not r.get("failed")]
    for r in ok:
        lines.append(
            f"| {r['strategy']} | {r['method']} | {r['processes']} | "
            + " | ".join(_ranks(r, "load_peak_rss_mb") + _ranks(r, "peak_rss_mb"))
            + f" | {r['tokens_per_s']} | {r['wall_s']:.0f} |"
        )
    lines += [
        "",
        "fsdp/ddp ratio of the worst rank's peak:",
        "",
        "| method | load peak | training peak |",
        "|---|---|---|",
    ]
    for method in dict.fromkeys(r["method"] for r in ok):
        by = {r["strategy"]: r for r in ok if r["method"] == method}
        if "ddp" in by and "fsdp" in by:
            ratio = [
                max(x[key] for x in by["fsdp"]["per_rank"])
                / max(x[key] for x in by["ddp"]["per_rank"])
                for key in ("load_peak_rss_mb", "peak_rss_mb")
            ]
            lines.append(f"| {method} | {ratio[0]:.2f} | {ratio[1]:.2f} |")
    lines += [
        "",
        "sampled maxima from /proc/<pid>/status (each field's own max), MB:",
        "",
        "| run | rank | VmRSS | RssAnon | RssFile | RssShmem |",
        "|---|---|---|---|---|---|",
    ]
    for r in ok:
        for rank, s in r["sampled_mb"].items():
            lines.append(
                f"| {r['name']} | {rank} | "
                + " | ".join(str(s.get(k, "-")) for k in STATUS_KEYS)
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,lora")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--work-dir", default="/tmp/keel-bench-fsdp")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the one-process full fine-tune"
    )
    parser.add_argument("--build", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        return build_model(Path(args.build))
    work = Path(args.work_dir).resolve()
    info = ensure_model(work)
    print(
        f"model: {info['params']:,} parameters ({info['params'] / 1e9:.3f} B); a full "
        f"replica for full fine-tuning is ~{info['params'] * 16 / 2**30:.2f} GiB",
        flush=True,
    )
    make_dataset(work / "data.json")
    methods = args.methods.split(",")
    results = []
    if "full" in methods and not args.no_baseline:
        results.append(run_one(work, "ddp", "full", nproc=1))
    for method in methods:
        for strategy in args.strategies.split(","):
            results.append(run_one(work, strategy, method, nproc=2))
    print(table(results, info["params"]))
    out = work / "fsdp_memory.json"
    out.write_text(json.dumps({"params": info["params"], "arch": ARCH, "runs": results}, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
