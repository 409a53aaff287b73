"""README.md model cards for the folders keel writes (trained adapters and models, exports).

PEFT's `save_pretrained` writes a template card whose every field says "[More Information
Needed]"; keel replaces it with what it knows: the base model, the data, the method and
stage, the steps and final loss, keel's version, and how to load the folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keel import __version__

CARD_FILE = "README.md"


@dataclass(frozen=True, kw_only=True)
class ModelCard:
    """What a card says about one folder; None/empty fields are left out."""

    base_model: str  # as the user named it: a path, a hub id or bundled:NAME
    adapter: bool  # a PEFT adapter (else a full model)
    method: str | None = None  # lora | qlora | full | freeze
    stage: str | None = None  # pt | sft | dpo | ...
    datasets: tuple[str, ...] = ()
    steps: int | None = None
    final_loss: float | None = None
    made_by: str = "trained"  # trained | exported (merged by `keel export`)
    extra: tuple[tuple[str, str], ...] = ()  # more (name, value) rows for the table

    def render(self, folder: Path) -> str:
        """The card's markdown; `folder` is where it will be read from (for the examples)."""
        kind = f"{'OFT' if self.method == 'oft' else 'LoRA'} adapter" if self.adapter else "model"
        tags = [t for t in ("keel", self.method, self.stage) if t]
        head = [
            "---",
            f"base_model: {self.base_model}",
            f"library_name: {'peft' if self.adapter else 'transformers'}",
            f"tags: [{', '.join(tags)}]",
            "---",
            f"# {folder.name}",
            "",
            f"A {kind} {self.made_by} with keel {__version__} from `{self.base_model}`.",
            "",
            "| | |",
            "|---|---|",
            *(f"| {name} | {value} |" for name, value in self._rows()),
            "",
        ]
        return "\n".join([*head, *self._usage(folder)]) + "\n"

    def _rows(self) -> list[tuple[str, str]]:
        loss = None if self.final_loss is None else f"{self.final_loss:.4f}"
        rows = [
            ("base model", f"`{self.base_model}`"),
            ("method", self.method),
            ("stage", self.stage),
            ("data", ", ".join(f"`{d}`" for d in self.datasets) or None),
            ("steps", None if self.steps is None else str(self.steps)),
            ("final training loss", loss),
            *self.extra,
            ("keel", __version__),
        ]
        return [(name, value) for name, value in rows if value]

    def _usage(self, folder: Path) -> list[str]:
        where = str(folder)
        if self.adapter:
            python = [
                "from peft import AutoPeftModelForCausalLM",
                "from transformers import AutoTokenizer",
                "",
                f'model = AutoPeftModelForCausalLM.from_pretrained("{where}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
            ]
            also = [
                "Merge it into its base for tools that do not read adapters:",
                "",
                f"    keel export --model {where} --out {where}-merged",
                "",
            ]
        else:
            python = [
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                "",
                f'model = AutoModelForCausalLM.from_pretrained("{where}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
            ]
            also = []
        return [
            "## Use it",
            "",
            "Chat with it, or serve it (OpenAI-compatible API):",
            "",
            f'    keel chat --model {where} --prompt "Who are you?"',
            f"    keel serve --model {where}",
            "",
            *also,
            "In Python:",
            "",
            "```python",
            *python,
            "```",
        ]


def write_model_card(folder: Path, card: ModelCard, *, shown_as: Path | None = None) -> None:
    """Write `card` as folder/README.md (replacing PEFT's template card); the examples name
    `shown_as`, where the folder will end up (default: `folder`)."""
    text = card.render(shown_as or folder)
    (folder / CARD_FILE).write_text(text, encoding="utf-8")


def export_card(model: str, adapter: str | None, dtype: str) -> ModelCard:
    """The card of a `keel export` folder: what it was merged from and, when that was a keel
    output folder (config.yaml, keel_run.json), how it was trained."""
    import json

    import yaml

    source = Path(adapter or model).expanduser()
    config = source / "config.yaml"
    run = source / "keel_run.json"
    trained = yaml.safe_load(config.read_text(encoding="utf-8")) if config.is_file() else {}
    summary = json.loads(run.read_text(encoding="utf-8")) if run.is_file() else {}
    train = trained.get("train", {})
    return ModelCard(
        base_model=model if adapter or not trained else trained["model"]["path"],
        adapter=False,
        method=trained.get("method", {}).get("type"),
        stage=train.get("stage"),
        datasets=tuple(d["path"] for d in trained.get("data", {}).get("datasets", [])),
        steps=summary.get("steps"),
        final_loss=summary.get("final_loss"),
        made_by="exported (merged)" if adapter or trained else "exported",
        extra=(("merged from", f"`{adapter or model}`"), ("dtype", dtype)),
    )
