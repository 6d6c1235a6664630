"""Printing to the terminal with rich, never reading what the user wrote as markup.

Paths, spec names and messages can hold square brackets (``runs/[v2].yaml``): rich would read ``[/x]`` as a closing tag
and fail, or take ``[v2]`` for a style and drop it. dora styles only its own labels, as ``Text`` spans, and prints every
other string with markup off.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text


def error(console: Any, message: str, *, label: str = "error") -> None:
    """``label: message``, the label in bold red, the message exactly as written."""
    console.print(Text.assemble((label, "bold red"), ": ", message))


def say(console: Any, message: str, *, style: str | None = None) -> None:
    """One message exactly as written (optionally in one style)."""
    console.print(Text(message, style=style or ""))


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, `kill`, a container stopping): a run stops as on Ctrl-C, between two of its events, with
    the resume hint (``dora.runtime.controller``); the exit code is 143, as a shell reports a process SIGTERM ended."""


def interrupted_exit_code(exc: KeyboardInterrupt) -> int:
    """130 after Ctrl-C (128 + SIGINT), 143 after SIGTERM (128 + SIGTERM)."""
    return 143 if isinstance(exc, Terminated) else 130
