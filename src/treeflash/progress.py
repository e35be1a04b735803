"""Progress for long work on stderr (model loading, prefill, decode, doctor's checks, sweeps):
tqdm bars and a rich spinner, drawn only when stderr is a terminal and the command was not
asked to be quiet (--json, -q), so that pipes and logs get the results alone.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator


def wanted(quiet: bool = False) -> bool:
    """Draw progress: stderr is a terminal and nobody asked for quiet."""
    return not quiet and sys.stderr.isatty()


def bar(total: int | None, desc: str, *, show: bool, unit: str = "it", leave: bool = False):
    """A tqdm bar on stderr (a silent one when `show` is False)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not show, leave=leave, file=sys.stderr,
                dynamic_ncols=True, unit_scale=unit == "tok")


@contextlib.contextmanager
def spinner(text: str, *, show: bool) -> Iterator[None]:
    """A spinner with the elapsed time while a step of unknown length runs (loading a model)."""
    if not show:
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        progress.add_task(text, total=None)
        yield


class Stopwatch:
    """Seconds since creation, for the one-line summaries."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def __str__(self) -> str:
        s = self.seconds
        return f"{s:.1f} s" if s < 120 else f"{int(s // 60)} min {int(s % 60)} s"
