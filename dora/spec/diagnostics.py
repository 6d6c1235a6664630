"""Diagnostics: located, collected error messages for user input.

A diagnostic names the YAML path of the offending field (``cluster.nodes``), its line in the file, what is
wrong, and how to fix it. Loaders collect every diagnostic they can find and raise them together as a
``SpecError`` so the user fixes a spec in one round trip, never a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

PathPart = str | int
Path = tuple[PathPart, ...]


def format_path(path: Path) -> str:
    """``("placement", "rollout", "tp")`` -> ``placement.rollout.tp``; list indices as ``[i]``; ``<document>`` for the
    file as a whole (a YAML syntax error, a file that cannot be read)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "<document>"


@dataclass(frozen=True, kw_only=True)
class Diagnostic:
    path: Path
    """YAML path of the field the problem is about (empty for the document itself)."""
    message: str
    """What is wrong, with the offending value and, for arithmetic checks, the arithmetic."""
    hint: str = ""
    """How to fix it."""
    line: int | None = None
    """1-based line in the spec file, when known."""
    file: str = ""
    """The file the line refers to (the spec, or a file it references)."""

    def render(self) -> str:
        where = format_path(self.path)
        if self.line is not None:
            where += f" (line {self.line})"
        text = f"{where}: {self.message}"
        if self.hint:
            text += f"\n    to fix: {self.hint}"
        return text

    def to_json(self) -> dict[str, object]:
        return {
            "path": format_path(self.path),
            "line": self.line,
            "file": self.file,
            "message": self.message,
            "hint": self.hint,
        }


class SpecError(Exception):
    """One or more diagnostics for a spec file; raised after collecting all of them."""

    def __init__(self, file: str, diagnostics: Sequence[Diagnostic]):
        self.file = file
        self.diagnostics = tuple(d if d.file else replace(d, file=file) for d in diagnostics)
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.diagnostics)
        head = f"{self.file}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head] + ["  " + d.render().replace("\n", "\n  ") for d in self.diagnostics])


DID_YOU_MEAN_CUTOFF = 0.6
"""difflib's similarity a candidate needs to be suggested."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """A ' — did you mean 'x'?' suffix for the nearest candidate, or ''."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=DID_YOU_MEAN_CUTOFF)
    return f" — did you mean '{close[0]}'?" if close else ""
