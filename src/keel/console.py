"""What keel's commands print: their own lines, and the libraries' progress bars kept off.

datasets and transformers draw a progress bar for every split they generate and every
checkpoint they load or write ("Generating train split", "Loading weights"): on every
command, meaningless to a user, and in a log file a long line of carriage returns. keel
turns them off through the libraries' own switches (`--verbose` leaves them on).
"""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """Print a line at once, also when stdout is a pipe (so it keeps its place in a log
    among the lines written to stderr)."""
    print(message, flush=True)


def quiet_libraries(*, data: bool, verbose: bool) -> None:
    """Turn off transformers' (and with `data`, datasets') progress bars unless `verbose`;
    huggingface_hub's download bars stay on a terminal, where a long download needs one."""
    if verbose:
        return
    from huggingface_hub.utils import enable_progress_bars as hub_bars_on
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # turns huggingface_hub's off as well
    if sys.stderr.isatty():
        hub_bars_on()
    if data:  # importing datasets takes a second: only for the commands that read data
        import datasets

        datasets.disable_progress_bars()  # after the hub's: datasets' bars are hub bars
