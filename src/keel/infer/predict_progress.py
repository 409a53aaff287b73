"""What an interrupted `keel predict` had answered, so that the same command answers only
the rest (a preempted job, Ctrl-C, a crash an hour into a large dataset).

Each process appends its answers, one JSON line per chunk of rows, to its own file beside
the output folder: `.<out>.predict-progress-<rank>-of-<world>.jsonl`. The first line is the
request's fingerprint: the model (its path and a sample of every weight: a retrained model in
the same folder is another model), the adapter, the prompts' token ids and images, the
sampling and the seed, and the process's place. A run that finds a file with its own
fingerprint keeps its answers; a file of another request is replaced, saying so. Each line
is flushed and fsynced as it is written; a torn last line (the process killed mid-write) is
ignored. The file goes once the output folder is written. keel touches only files whose
first line marks them as its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from keel.infer.batch_generate import Completion

MARK = "keel_predict_progress"
Log = Callable[[str], None]


def progress_path(out: Path, rank: int, world_size: int) -> Path:
    return out.parent / f".{out.name}.predict-progress-{rank}-of-{world_size}.jsonl"


def fingerprint(model, request_facts: dict, prompts) -> str:
    """A digest of what decides the answers: `request_facts` (JSON: model path, adapter,
    sampling, seed, process place), the prompts' ids and images, and the weights (the first
    values of every parameter, and its shape)."""
    import torch

    digest = hashlib.sha256(json.dumps(request_facts, sort_keys=True).encode())
    for prompt in prompts:
        digest.update(json.dumps([prompt.ids, repr(prompt.images)]).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            sample = param.detach().reshape(-1)[:64].float().cpu()
            digest.update(name.encode() + str(tuple(param.shape)).encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


class Progress:
    """One process's answers so far (row index -> Completion), kept on disk as it goes."""

    def __init__(self, path: Path, digest: str, log: Log):
        self.path, self.digest, self.log = path, digest, log
        self.answers: dict[int, Completion] = {}

    def load(self) -> dict[int, Completion]:
        """The answers an earlier run of this request kept; {} when there are none. A file
        of another request (keel's) is started over; one keel did not write is refused."""
        if not self.path.exists():
            self._start()
            return {}
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        head = _json(lines[0]) if lines else None
        if not isinstance(head, dict) or MARK not in head:
            from keel.errors import KeelError

            raise KeelError(
                f"{self.path} is in keel predict's place for its progress but keel did not "
                f"write it; move it away, or give another --out"
            )
        if head[MARK] != self.digest:
            self.log(f"predict: {self.path} holds another request's answers; starting over")
            self._start()
            return {}
        for line in lines[1:]:
            chunk = _json(line)
            if not isinstance(chunk, list):  # a torn last line: the process died writing it
                break
            for index, token_ids, reason in chunk:
                self.answers[int(index)] = Completion(list(token_ids), reason)
        self._rewrite()  # drop a torn line, so that appends start on a line of their own
        return dict(self.answers)

    def add(self, pairs: list[tuple[int, Completion]]) -> None:
        """Keep `pairs` (row index, answer): one line, on disk before this returns."""
        self.answers.update(pairs)
        line = json.dumps([[i, a.token_ids, a.finish_reason] for i, a in pairs])
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def _start(self) -> None:
        self.answers = {}
        self._rewrite()

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)  # --out's folder, as it will be
        tmp = self.path.with_name(self.path.name + ".tmp")
        chunk = [[i, a.token_ids, a.finish_reason] for i, a in sorted(self.answers.items())]
        lines = [json.dumps({MARK: self.digest})] + ([json.dumps(chunk)] if chunk else [])
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _json(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
