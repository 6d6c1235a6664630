"""Reading a file the user named: a regular file only, and never more than a size limit.

Every input dora reads from a path it was given (a spec, the config.json or histogram a spec references, a saved
plan, a calibration file) goes through ``read_input_file``. It opens without blocking, so a FIFO cannot hang the
command, checks on the open descriptor that it holds a regular file, so ``/dev/zero`` or a pipe is refused before
a byte is read, and reads at most ``limit + 1`` bytes, so a file that grows or lies about its size cannot exhaust
memory. ``loads_json`` parses such a file's JSON with one kind of error for everything Python's parser refuses.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any


class InputFileError(Exception):
    """Why a file cannot be read, as a phrase that completes "'PATH' ..." (``does not exist``, ``is a directory``)."""

    def __init__(self, why: str, *, missing: bool = False):
        super().__init__(why)
        self.why = why
        self.missing = missing
        """The path names nothing (callers say where they looked)."""


_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)


def read_input_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at ``path``; ``InputFileError`` when it is missing, not a regular file (a
    directory, device, pipe or socket), larger than ``limit`` bytes, or unreadable."""
    try:
        fd = os.open(path, _FLAGS)  # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting
    except ValueError:  # os.open refuses a path with a NUL byte before asking the system
        raise InputFileError("is not a valid path (it contains a NUL byte)") from None
    except FileNotFoundError:
        raise InputFileError("does not exist", missing=True) from None
    except IsADirectoryError:
        raise InputFileError("is a directory") from None
    except OSError as exc:
        raise InputFileError(f"cannot be read: {exc.strerror or type(exc).__name__}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise InputFileError("is a directory")
        if not stat.S_ISREG(mode):
            raise InputFileError("is not a regular file (a device, pipe or socket)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise InputFileError(f"cannot be read: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InputFileError(f"is larger than {limit:,} bytes")
    return data


MAX_JSON_INT_DIGITS = 308
"""Longest integer a JSON input may hold: longer ones exceed a float (1.8e308), where dora's arithmetic would
overflow, and past 4300 digits Python's int() refuses them."""


def nearest_existing(path: Path) -> Path:
    """``path`` made absolute, or its nearest parent that exists: where making it as a directory starts (a file
    there stops it). Raises ``OSError`` where a parent cannot be examined."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        raise ValueError(f"it holds an integer of {digits:,} digits ({text[:12]}...), beyond any float")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out and out[key] != value:
            raise ValueError(f"the key {key!r} appears twice in one object with different values ({out[key]!r} and "
                             f"{value!r}; JSON readers differ on which one wins): remove one of them")
        out[key] = value
    return out


def loads_json(text: str, **kwargs: Any) -> Any:
    """``json.loads`` for a file the user named: ``ValueError`` (a ``JSONDecodeError`` for bad syntax) also when it
    nests too deeply for Python's parser, holds an integer no float can hold, or gives one key two values in one object."""
    try:
        return json.loads(text, parse_int=_bounded_int, object_pairs_hook=_unique_keys, **kwargs)
    except RecursionError:
        raise ValueError("it nests too deeply") from None
