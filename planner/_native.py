"""Which planner modules may run compiled (mypyc), and the guard that keeps a stale build from running.

``hatch_build.py`` compiles ``NATIVE_SOURCES`` at install time into C extensions placed next to the sources, and
records each source's SHA-256 in ``planner/_native_build.json``. Python's import system prefers an extension over
the ``.py`` beside it, so an edited source would silently keep running its old compiled self. ``use_current_code()``
(called once, from ``planner/__init__.py``, before any of these modules is imported) therefore compares the hashes;
when the extensions are missing for any module, stale, or ``DORA_PURE_PYTHON=1``, it loads all of them from their
sources (all or none: the compiled modules call each other's native code directly) and says why in ``STATUS``.
Nothing else about the planner changes: the same code and the same results, in under half the instructions (the
simulator's heaps, ``planner/sim/seqheap.py``, use unboxed vectors only when compiled).
This file is plain Python and is never compiled itself.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

NATIVE_SOURCES = (
    "planner/policies/vocabulary.py",
    "planner/policies/config.py",
    "planner/policies/base.py",
    "planner/policies/batch.py",
    "planner/policies/continuous.py",
    "planner/policies/streaming.py",
    "planner/sim/costmodel.py",
    "planner/sim/seqheap.py",
    "planner/sim/simulator.py",
)
"""Relative to the directory holding ``planner/``: the simulator's hot path and what it calls per event (the policies,
once per finished trajectory; the cost model's decode step time; the heaps of events and of running sequences). Not ``workload.py``, whose length sampling is the
next largest cost: compiled, its frozen slotted dataclass loses the pickling support ``dataclasses`` gives it (the
benchmarks pickle a candidate's inputs)."""

MANIFEST = "planner/_native_build.json"

STATUS = "python: not checked yet"
"""``compiled (mypyc)`` or ``python: <why>``: what ``use_current_code`` decided, for benchmarks and bug reports."""


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the listed modules as their ``.py`` files, ahead of the default finders (which prefer extensions)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        return None if file is None else importlib.util.spec_from_file_location(fullname, file)


def _has_extension(source: Path) -> bool:
    stem = source.with_suffix("")
    return any(Path(f"{stem}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _decide(root: Path) -> tuple[bool, str]:
    """(use the extensions, status)."""
    sources = [root / s for s in NATIVE_SOURCES]
    if os.environ.get("DORA_PURE_PYTHON") == "1":
        return False, "python: DORA_PURE_PYTHON=1"
    built = [_has_extension(s) for s in sources]
    if not any(built):
        return False, "python: not compiled (install with a C compiler, or `python hatch_build.py`)"
    try:
        recorded = json.loads((root / MANIFEST).read_text())["sources"]
    except (OSError, ValueError, KeyError):
        return False, f"python: compiled modules without a readable {MANIFEST} (an interrupted build?)"
    if not all(built):
        return False, "python: some compiled modules are missing (an interrupted build, or another Python version)"
    for rel, path in zip(NATIVE_SOURCES, sources, strict=True):
        if recorded.get(rel) != hashlib.sha256(path.read_bytes()).hexdigest():
            return False, f"python: {rel} changed since it was compiled (rebuild: `python hatch_build.py`)"
    return True, "compiled (mypyc)"


def use_current_code() -> None:
    """Make the modules of ``NATIVE_SOURCES`` import from their sources unless their extensions are current."""
    global STATUS
    root = Path(__file__).resolve().parent.parent
    native, STATUS = _decide(root)
    if native:
        return
    sys.meta_path.insert(0, _SourceFinder({s[:-3].replace("/", "."): root / s for s in NATIVE_SOURCES}))
    if "changed since" in STATUS or "interrupted" in STATUS:
        warnings.warn(f"dora planner {STATUS}; running the Python sources (same results, slower)",
                      RuntimeWarning, stacklevel=2)
