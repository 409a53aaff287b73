"""keel's optional extras (pyproject's optional-dependencies): which modules each needs, and
the one message every command gives when one is missing.

Checked with `importlib.util.find_spec`, which locates a package without importing it, so a
missing extra is a user error (exit 2, the pip command) before any model or data loads.
"""

from __future__ import annotations

import importlib.util

from keel.errors import KeelError

# extra -> the modules it installs (import names, not distribution names)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "sse_starlette"),
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "qlora": ("torchao",),
    "bnb": ("bitsandbytes",),
}


class MissingExtra(KeelError):
    """An optional extra that a command or config key needs is not installed."""


def install_command(extra: str) -> str:
    """The pip command that installs `extra`."""
    return f"pip install 'keel[{extra}]'"


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` that are not installed here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def extra_problem(extra: str, needed_for: str) -> str | None:
    """`needed_for needs X, which is not installed; pip install 'keel[extra]'`, or None."""
    missing = missing_modules(extra)
    if not missing:
        return None
    return (
        f"{needed_for} needs {', '.join(missing)}, which "
        f"{'is' if len(missing) == 1 else 'are'} not installed; "
        f"install it with {install_command(extra)}"
    )


def require_extra(extra: str, needed_for: str) -> None:
    """Raise MissingExtra (exit 2) naming the pip command when `extra` is not installed."""
    problem = extra_problem(extra, needed_for)
    if problem:
        raise MissingExtra(problem)
