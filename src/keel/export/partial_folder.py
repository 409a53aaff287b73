"""Writing a folder all at once: build it under a hidden temporary name, then rename it.

The temporary folder (`.<name>.partial-*`, beside the target) holds a marker naming the
process that builds it. SIGTERM while it is being built removes it and exits with 143
(128 + SIGTERM), as an unhandled SIGTERM would. A process killed outright (SIGKILL, power
loss) leaves it behind; the next write of the same target removes it once its marker shows
that its process has ended. A temporary folder without the marker is never removed: keel
cannot tell it is its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from keel.errors import ModelError
from keel.files import fsync_tree
from keel.owner import parse_owner, this_process

Log = Callable[[str], None]
PARTIAL_MARKER = ".keel-partial"


def write_folder_atomically(out: Path, write: Callable[[Path], None], log: Log) -> None:
    """Run `write(folder)` on a temporary folder beside `out`, then rename it to `out`.

    The rename is atomic on one filesystem: `out` is either absent (or the empty folder it
    was) or complete, never half-written.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out, log)
    with _sigterm_exits():
        tmp = Path(tempfile.mkdtemp(prefix=_prefix(out), dir=out.parent))
        try:
            (tmp / PARTIAL_MARKER).write_text(this_process().to_json(), encoding="utf-8")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model is read like any folder
            write(tmp)
            (tmp / PARTIAL_MARKER).unlink()
            for path in tmp.iterdir():  # safetensors shards are written private (0600)
                os.chmod(path, 0o644)
            fsync_tree(tmp)
            _rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def remove_leftovers(out: Path, log: Log) -> list[Path]:
    """Remove the temporary folders of earlier writes of `out` whose process has ended;
    returns them. Unmarked ones and those of running processes are left alone."""
    removed = []
    for path in sorted(p for p in out.parent.iterdir() if p.name.startswith(_prefix(out))):
        marker = path / PARTIAL_MARKER
        if path.is_symlink() or not marker.is_file():
            if path.is_dir() and not path.is_symlink():
                log(f"note: {path} looks like an interrupted write but keel did not mark it")
            continue
        owner = parse_owner(marker.read_text(encoding="utf-8", errors="replace"))
        if owner is not None and owner.is_dead():
            log(f"removing {path}, left by an interrupted write ({owner.describe()})")
            shutil.rmtree(path)
            removed.append(path)
    return removed


def _prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _rename(tmp: Path, out: Path) -> None:
    try:
        os.rename(tmp, out)  # replaces `out` only if it is an empty folder
    except OSError as exc:
        raise ModelError(
            f"--out {out}: cannot put the export there ({exc.strerror}); something "
            f"wrote to it meanwhile. Nothing of {out} was changed: give a new folder"
        ) from None


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the body, so its clean-up runs (main thread only:
    Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
