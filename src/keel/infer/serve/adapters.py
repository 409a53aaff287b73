"""Named LoRA adapters over one base model, so one batch can mix them (PEFT `adapter_names`)."""

from __future__ import annotations

from pathlib import Path

from keel.errors import ModelError
from keel.infer.serve.adapter_files import (
    AdapterCaps,
    check_against_base,
    inspect_adapter,
)

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch
MAX_NAME_LENGTH = 200


class AdapterSet:
    """The served model names: the base, plus one name per loaded LoRA adapter.

    PEFT wraps the base model the first time an adapter is loaded, so `model` may change
    when adapters come and go; callers always use `adapters.model`. Served names can be
    any text (paths included); PEFT gets its own safe names (`keel_adapter_<n>`), since
    they become module names. Only the scheduler thread may call load/unload; the name
    table is replaced, never changed in place, so other threads can read it any time.
    """

    def __init__(
        self, model, base_name: str, caps: AdapterCaps | None = None, *, per_row: bool = True
    ):
        self.model = model
        self.base_name = base_name
        self.caps = caps or AdapterCaps()
        # False: every row runs `model` as it is, a PEFT model with its active adapter (the
        # policy being trained); forward passes name no adapters and none can be loaded.
        self.per_row = per_row
        self._keys: dict[str, str] = {}  # served name -> PEFT adapter name
        # served name -> the modules it trains in full (PEFT modules_to_save), where it has any
        self._whole: dict[str, list[str]] = {}
        self._loaded = 0

    @property
    def mixed(self) -> bool:
        """Whether forward passes need `adapter_names` (the model is a PEFT model)."""
        from peft import PeftModel

        return self.per_row and isinstance(self.model, PeftModel)

    def names(self) -> list[str]:
        return [self.base_name, *self._keys]

    def key(self, name: str) -> str:
        """PEFT's adapter name for served model `name`; KeyError if it is not served."""
        return BASE if name == self.base_name else self._keys[name]

    def adopt(self, name: str, key: str) -> None:
        """Serve an adapter the model already holds (a keel output dir loaded as the model)."""
        self._check_name(name)
        whole = sorted(getattr(self.model.peft_config[key], "modules_to_save", None) or [])
        self._check_alone(name, whole)
        self._keys = {**self._keys, name: key}
        self._whole = {**self._whole, name: whole} if whole else self._whole

    def load(self, name: str, path: str) -> None:
        """Load the LoRA adapter at `path` and serve it as `name`, after checking its files
        against `caps` and its shapes against the base model (ModelError says why not)."""
        from peft import PeftModel

        assert self.per_row, "a model served as it is takes no adapters"
        self._check_name(name)
        path = str(Path(path).expanduser())
        shapes = inspect_adapter(name, path, self.caps)
        if shapes.dora:
            raise ModelError(
                f"adapter {name!r} ({path}) is a DoRA adapter, which PEFT cannot batch with "
                f"other models' rows; serve it alone (keel serve --model {path}: merged into "
                f"its base), or merge it (keel export) and serve the merged model"
            )
        whole = list(shapes.in_full)
        self._check_alone(name, whole)
        if len(self._keys) >= self.caps.max_adapters:
            raise ModelError(
                f"this server holds at most {self.caps.max_adapters} adapters (--max-adapters) "
                f"and serves {self._listing()}; unload one first"
            )
        base = self.model.get_base_model() if self.mixed else self.model
        check_against_base(shapes, base, f"adapter {name!r} ({path})")
        self._loaded += 1
        key = f"keel_adapter_{self._loaded}"
        try:
            if self.mixed:
                self.model.load_adapter(path, adapter_name=key)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=key)
        except Exception as e:  # whatever PEFT raises on a bad adapter is the adapter's fault
            if self.mixed and key in self.model.peft_config:
                self.model.delete_adapter(key)  # drop a half-loaded adapter
            raise ModelError(
                f"adapter {name!r}: cannot load {path} on base {self.base_name}: "
                f"{type(e).__name__}: {e}; was it trained on this base model?"
            ) from e
        self.model.eval()
        self._keys = {**self._keys, name: key}
        self._whole = {**self._whole, name: whole} if whole else self._whole

    def unload(self, name: str) -> None:
        """Stop serving adapter `name` and free its weights."""
        if name == self.base_name:
            raise ModelError(f"{name!r} is the base model; only adapters can be unloaded")
        if name not in self._keys:
            raise ModelError(f"no adapter named {name!r} is loaded; loaded: {self._listing()}")
        key = self._keys[name]
        self._keys = {n: k for n, k in self._keys.items() if n != name}
        self._whole = {n: m for n, m in self._whole.items() if n != name}
        if not self._keys:
            # PEFT keeps pointing at a deleted last adapter; unwrap to the plain model.
            self.model = self.model.unload()
            return
        self.model.delete_adapter(key)
        # PEFT needs a live active adapter; which one is irrelevant, rows name their own.
        self.model.set_adapter(next(iter(self._keys.values())), inference_mode=True)

    def _check_alone(self, name: str, whole: list[str]) -> None:
        """An adapter that trains modules in full is served alone (beside the base): PEFT's
        mixed batch looks up every row's adapter in each such module, and a row of another
        adapter, which has no copy there, fails the batch."""
        if not self._keys or not (whole or self._whole):
            return
        if whole:
            why = f"adapter {name!r} trains {', '.join(whole)} in full (PEFT modules_to_save)"
        else:
            (other, modules), *_ = self._whole.items()
            why = f"the served adapter {other!r} trains {', '.join(modules)} in full (PEFT modules_to_save)"
        raise ModelError(
            f"{why}; PEFT cannot batch such an adapter with other adapters, so it is served "
            f"alone beside the base (now serving {self._listing()}): unload the others first, "
            f"or merge it into its base (keel train with output.merge_lora) and serve that"
        )

    def _check_name(self, name: str) -> None:
        if not name or len(name) > MAX_NAME_LENGTH or name != name.strip():
            raise ModelError(
                f"adapter name {name!r} must be 1 to {MAX_NAME_LENGTH} characters, "
                "without leading or trailing spaces"
            )
        if name == self.base_name or name in self._keys:
            raise ModelError(f"a model named {name!r} is already served; pick another name")

    def _listing(self) -> str:
        return ", ".join(self._keys) or "(none)"
