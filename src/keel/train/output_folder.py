"""Which output folders a run may write into and delete from, and the lock it holds on one.

keel deletes only what it made. A run that starts in an absent or empty output.dir marks
it (`.keel-output`, JSON listing the final model's files, added before they are moved in).
Any other folder is refused (exit 2, naming a file keel did not write) before a model is
loaded, so a project folder, or one that merely holds a config.yaml, is never written into.
With output.overwrite=true a keel folder loses only keel's entries, each one logged; the
folder itself stays.

Folders written by keel before the marker existed are recognised, conservatively, by their
content: a config.yaml, plus a keel_run.json naming a keel version or a complete checkpoint,
and nothing at the top level that keel does not write (run files, checkpoints/ holding only
step folders, Hugging Face model and tokenizer files, a README.md only beside a PEFT
adapter). Such a folder is adopted: marked, then treated as keel's.

Rank 0 holds `.keel.lock` (an flock, the file naming the holder's pid, host and start time)
for the run's life; a second run into the folder exits 2 naming the holder. The kernel
drops an flock when its process dies, so the lock of a run that was killed is taken over,
with a log line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

from keel.checkpoint.layout import CHECKPOINTS, META, complete_checkpoints, looks_like_step_dir
from keel.distributed.process_group import DistContext, on_main
from keel.distributed.watchdog import DIAGNOSTICS
from keel.errors import KeelError
from keel.owner import Owner, parse_owner, this_process
from keel.train.completions_log import COMPLETIONS_FILE
from keel.train.metrics import METRICS_FILE, WANDB_RUN_ID_FILE

Log = Callable[[str], None]
MARKER = ".keel-output"
LOCK = ".keel.lock"
FINAL_SUMMARY = "keel_run.json"
CONFIG_COPY = "config.yaml"
# Top-level entries any keel run may write; the final model's files are listed in MARKER.
RUN_ENTRIES = frozenset(
    {
        CONFIG_COPY,
        METRICS_FILE,
        COMPLETIONS_FILE,
        CHECKPOINTS,
        DIAGNOSTICS,
        "tensorboard",
        "wandb",
        WANDB_RUN_ID_FILE,
        "loss.png",
        FINAL_SUMMARY,
        ".tmp-final",
        "merged",
    }
)
_BOOKKEEPING = frozenset({MARKER, MARKER + ".tmp", LOCK})
# What save_pretrained writes for a model and its tokenizer (older keels' final outputs).
_MODEL_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_KEEP_OUT = "choose an empty or new output.dir, or move the files away"


def unwritable_reason(out: Path) -> str | None:
    """Why output.dir `out` cannot be made or written (None: it can). Touches nothing."""
    if out.exists() and not out.is_dir():
        return f"output.dir {out} is a file, not a folder; set output.dir to a folder path"
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return (
            f"output.dir {out} cannot be created: {existing} is a file, not a folder; "
            f"set output.dir to a folder path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        return (
            f"output.dir {out} cannot be written: {existing} is not writable by this user; "
            f"choose a folder you can write to, or change its permissions"
        )
    return None


@contextmanager
def claim_output_dir(out: Path, dist: DistContext, log: Log):
    """Hold `out` for the body: check it can be written, lock it, check that everything in
    it is keel's, and mark it. Rank 0 does this; every rank gets a refusal (KeelError)."""
    claim = _Claim(out)
    on_main(dist, lambda: claim.take(log))
    try:
        yield
    finally:
        if dist.is_main:
            claim.release()


class _Claim:
    def __init__(self, out: Path):
        self.out = out
        self.lock = OutputLock(out)
        self.created = False  # keel made the folder
        self.fresh = False  # the folder was empty: a run that writes nothing leaves it so

    def take(self, log: Log) -> None:
        problem = unwritable_reason(self.out)
        if problem:
            raise KeelError(problem)
        self.created = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.lock.acquire(log)
            self.fresh = not _entries(self.out)
            check_ownership(self.out, log)
        except OSError as exc:
            self.release()
            raise KeelError(
                f"output.dir {self.out} cannot be written ({exc.strerror or exc}); choose a "
                f"folder you can write to"
            ) from None
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        self.lock.release()
        try:
            if self.fresh and set(os.listdir(self.out)) <= {MARKER}:
                (self.out / MARKER).unlink(missing_ok=True)
                if self.created:
                    self.out.rmdir()
        except OSError:
            pass  # tidying only: never hide the error that ended the run


def check_ownership(out: Path, log: Log) -> None:
    """Refuse (KeelError) a folder holding anything keel did not write; mark an empty one,
    or one an older keel wrote (logged)."""
    names = _entries(out)
    written = _read_marker(out)
    if written is None and not names:
        _write_marker(out, [])
        return
    older = written is None
    if older:
        written = _older_keel_run(out, names)
        if written is None:
            raise KeelError(
                f"output.dir {out} is not empty and was not made by keel (no {MARKER} "
                f"marker): it holds {_example(out, names)}. keel writes only into an empty "
                f"folder or one it made, and output.overwrite deletes only what keel wrote; "
                f"{_KEEP_OUT}"
            )
    foreign = _foreign_entry(out, names, RUN_ENTRIES | written)
    if foreign is not None:
        raise KeelError(
            f"output.dir {out} is not empty and holds {foreign}, which keel did not write; "
            f"keel will not write into, or overwrite, a folder with other files: {_KEEP_OUT}"
        )
    if older:
        _write_marker(out, written)
        log(f"output.dir {out} was written by an older keel: marked as keel's ({MARKER})")


def has_run_files(out: Path) -> bool:
    """Whether `out` holds anything besides keel's own marker and lock."""
    return out.is_dir() and bool(_entries(out))


def remove_run_files(out: Path, log: Log) -> None:
    """output.overwrite: delete keel's entries of `out` (each logged), keep the folder.
    Symbolic links are unlinked, never followed."""
    check_ownership(out, log)
    for name in sorted(_entries(out)):
        path = out / name
        log(f"output.overwrite: removing {path}")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    _write_marker(out, [])


def record_written(out: Path, names: Iterable[str]) -> None:
    """Add the final model's file names to the marker, before they are moved into `out`."""
    _write_marker(out, (_read_marker(out) or set()) | set(names))


def _entries(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()} - _BOOKKEEPING


def _read_marker(out: Path) -> set[str] | None:
    """The model files the marker lists; None: no marker. A damaged one lists nothing."""
    path = out / MARKER
    if not path.is_file():
        return None
    try:
        written = json.loads(path.read_text(encoding="utf-8")).get("written", [])
        return {str(name) for name in written}
    except (ValueError, AttributeError, TypeError, OSError):
        return set()


def _write_marker(out: Path, written: Iterable[str]) -> None:
    from keel import __version__

    tmp = out / (MARKER + ".tmp")
    body = {"made_by": "keel", "keel_version": __version__, "written": sorted(set(written))}
    tmp.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / MARKER)


def _older_keel_run(out: Path, names: set[str]) -> set[str] | None:
    """The model files of a folder an older keel wrote (no marker), or None if it is not one."""
    if CONFIG_COPY not in names or not (_keel_summary(out) or _keel_checkpoint(out)):
        return None
    model = {
        name
        for name in names - RUN_ENTRIES
        if (out / name).is_file() and any(fnmatch(name, pattern) for pattern in _MODEL_FILES)
    }
    if "README.md" in names and "adapter_config.json" in model:  # PEFT's model card
        model.add("README.md")
    return model


def _keel_summary(out: Path) -> bool:
    try:
        return "keel_version" in json.loads((out / FINAL_SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _keel_checkpoint(out: Path) -> bool:
    for checkpoint in complete_checkpoints(out):
        try:
            if "step" in json.loads((checkpoint / META).read_text(encoding="utf-8")):
                return True
        except (OSError, ValueError, TypeError):
            continue
    return False


def _foreign_entry(out: Path, names: set[str], allowed: set[str]) -> Path | None:
    for name in sorted(names):
        if name not in allowed:
            return out / name
    checkpoints = out / CHECKPOINTS
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        for child in sorted(checkpoints.iterdir()):
            if not looks_like_step_dir(child):
                return child
    return None


def _example(out: Path, names: set[str]) -> Path:
    """A file to name in a refusal: one keel never writes when there is one."""
    unusual = sorted(names - RUN_ENTRIES)
    return out / (unusual[0] if unusual else sorted(names)[0])


class OutputLock:
    """`.keel.lock` in an output folder: an flock held from `acquire` to `release`."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / LOCK
        self._fd: int | None = None

    def acquire(self, log: Log) -> None:
        """Take the lock, or raise KeelError naming the run that holds it."""
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if self._try_lock(fd, log):
                    self._fd = fd
            finally:
                if self._fd is None:
                    os.close(fd)

    def _try_lock(self, fd: int, log: Log) -> bool:
        """True: `fd` is locked and names this process. False: the file was replaced
        meanwhile (try again)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            self._refuse(_read_owner(fd))
        except OSError as exc:  # a filesystem without flock: the file's word only
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            locked = False
        try:
            if os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                return False  # released (unlinked) between our open and our flock
        except FileNotFoundError:
            return False
        previous = _read_owner(fd)
        if previous is not None and previous.pid != os.getpid():
            # On this host a live pid is believed over the flock (pids are checkable); on
            # another host only the flock can tell that its run has ended.
            here = previous.host == this_process().host
            if (here and not previous.is_dead()) or (not here and not locked):
                self._refuse(previous)
            log(
                f"output.dir {self.out}: taking over the lock of a keel run that is no longer "
                f"running ({previous.describe()})"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, this_process().to_json().encode(), 0)
        os.fsync(fd)
        return True

    def _refuse(self, holder: Owner | None) -> None:
        who = holder.describe() if holder else "a process that has not written its name yet"
        raise KeelError(
            f"output.dir {self.out} is in use by another keel run ({who}): wait for it to "
            f"end, or choose another output.dir. If no keel run uses it any more, delete "
            f"{self.path}"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before the flock goes: see _try_lock's stat
        finally:
            os.close(self._fd)
            self._fd = None


def _read_owner(fd: int) -> Owner | None:
    size = os.fstat(fd).st_size
    return parse_owner(os.pread(fd, size, 0).decode("utf-8", "replace")) if size else None
