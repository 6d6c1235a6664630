"""Printing to the terminal with rich, never reading what the user wrote as markup.

Paths, spec names and messages can hold square brackets (``runs/[v2].yaml``): rich would read ``[/x]`` as a closing tag
and fail, or take ``[v2]`` for a style and drop it. dora styles only its own labels, as ``Text`` spans, and prints every
other string with markup off.
"""

from __future__ import annotations

import argparse
import errno
import signal
from typing import Any

from rich.text import Text


def named(what: str) -> Any:
    """An argparse ``type`` refusing an empty path: ``Path("")`` is the working directory, so ``dora apply ''`` ran
    a ``plan.json`` found there and ``dora status ''`` looked for ``job.json`` in it."""
    def check(value: str) -> str:
        if not value:
            raise argparse.ArgumentTypeError(f"is empty: name {what}")
        return value

    return check


def make_console(*, stderr: bool = False, **options: Any) -> Any:
    """A rich ``Console`` whose write to a closed pipe raises ``BrokenPipeError`` for ``dora.cli.main`` to end the
    command with ``EXIT_CLOSED_PIPE``. rich's own reaction is ``SystemExit(1)``: the status of a spec error."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True  # nothing more from this console; the caller decides what the command does
            raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")

    return _Console(stderr=stderr, **options)


def error(console: Any, message: str, *, label: str = "error") -> None:
    """``label: message``, the label in bold red, the message exactly as written."""
    console.print(Text.assemble((label, "bold red"), ": ", message))


def say(console: Any, message: str, *, style: str | None = None) -> None:
    """One message exactly as written (optionally in one style)."""
    console.print(Text(message, style=style or ""))


class StatusLine:
    """One line of progress on a terminal, rewritten in place and cleared when done; nothing at all where the console
    is not a terminal (a pipe, a file, CI logs). Written from the calling thread: a spinner's refresh thread would
    keep ``dora plan`` from forking its simulations (``dora.parallel.fork_map`` forks only a single-threaded process)."""

    def __init__(self, console: Any) -> None:
        self.file = console.file if console.is_terminal else None
        self.shown = False

    def show(self, text: str) -> None:
        if self.file is not None:
            width = max(20, _terminal_columns(self.file) - 1)  # a wrapped line would not be rewritten in place
            self.file.write("\r\x1b[K" + text[:width])
            self.file.flush()
            self.shown = True

    def clear(self) -> None:
        if self.file is not None and self.shown:
            self.file.write("\r\x1b[K")
            self.file.flush()
            self.shown = False


def _terminal_columns(file: Any) -> int:
    import os

    try:
        return os.get_terminal_size(file.fileno()).columns or 80  # 0 where the terminal reports no size
    except (OSError, ValueError, AttributeError):
        return 80


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, `kill`, a container stopping): a run stops as on Ctrl-C, between two of its events, with
    the resume hint (``dora.runtime.controller``); the exit code is 143, as a shell reports a process SIGTERM ended."""


_signals: list[int] = []
"""The stop signals a run's handler received, the last one last (``note_signal``)."""


def note_signal(signum: int | None) -> None:
    """Record a stop signal (None: a run starts, forget the earlier ones). Ray re-raises a signal that comes while
    the main thread waits in ``ray.get`` as a plain ``KeyboardInterrupt``, so the exception's type alone would call
    a SIGTERM during the warm-up a Ctrl-C."""
    if signum is None:
        _signals.clear()
    else:
        _signals.append(signum)


EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE
"""141: standard output's reader went away (`dora validate specs/*.yaml | head -2`). The status of a process the
SIGPIPE killed, as `cat` or `git log` give it: not 1, the status of a spec error or an infeasible plan, and not 0,
since the command stopped before its work was done."""


def interrupted_exit_code(exc: KeyboardInterrupt) -> int:
    """130 after Ctrl-C (128 + SIGINT), 143 after SIGTERM (128 + SIGTERM)."""
    terminated = isinstance(exc, Terminated) or (bool(_signals) and _signals[-1] == signal.SIGTERM)
    return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
