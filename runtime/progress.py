"""Progress bars on stderr for long phases (sampling, training, generating), drawn with rich.

A bar is shown only when stderr is a terminal and stdout is not: results printed under a live bar on the
same screen would tear it, and then the results themselves show the progress. Library code never imports
rich: it takes a `ProgressFactory` (this module's `bar`, or None for silence).

    with bar("training the drafter", total=steps) as p:
        p.advance()
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Protocol


class Bar(Protocol):
    def advance(self, n: int = 1) -> None: ...
    def add_tokens(self, n: int) -> None: ...


ProgressFactory = Callable[[str, int], contextlib.AbstractContextManager[Bar]]


class _RichBar:
    def __init__(self, progress: object, task: object) -> None:
        self._progress, self._task, self._tokens = progress, task, 0

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)  # type: ignore[attr-defined]

    def add_tokens(self, n: int) -> None:
        self._tokens += n
        self._progress.update(self._task, tokens=self._tokens)  # type: ignore[attr-defined]


@contextlib.contextmanager
def bar(label: str, total: int) -> Iterator[Bar]:
    """A transient rich bar: done/total, tokens seen (`add_tokens`), elapsed time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]} tokens"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        # Results are written to the real stdout, never through rich's proxy (which goes to stderr).
        redirect_stdout=False,
        redirect_stderr=False,
        disable=not console.is_terminal or sys.stdout.isatty(),
    )
    task = progress.add_task(label, total=total, tokens=0)
    with progress:
        yield _RichBar(progress, task)


class _Silent:
    def advance(self, n: int = 1) -> None:
        pass

    def add_tokens(self, n: int) -> None:
        pass


@contextlib.contextmanager
def silent(label: str, total: int) -> Iterator[Bar]:
    """A ProgressFactory that shows nothing."""
    yield _Silent()


__all__ = ["Bar", "ProgressFactory", "bar", "silent"]
