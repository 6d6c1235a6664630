"""Reading YAML with line numbers, safely.

``read_yaml`` parses with ruamel's round-trip loader (no arbitrary object construction) and converts the
result to plain Python data while recording the 1-based line of every key and list item. The conversion walks
aliases by value, so a "billion laughs" document would expand exponentially: the walk counts the nodes it
produces and stops at ``MAX_NODES``, which bounds time and memory whatever the input.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from dora.spec.diagnostics import Diagnostic, Path, SpecError

MAX_FILE_BYTES = 1 << 20
"""Specs are small; anything above 1 MiB is rejected before parsing."""
MAX_NODES = 20_000
"""Largest number of YAML nodes after alias expansion."""
MAX_DEPTH = 32


@dataclass(frozen=True)
class YamlDoc:
    data: Any
    lines: dict[Path, int]

    def line_of(self, path: Path) -> int | None:
        """Line of the deepest known prefix of ``path`` (an unknown leaf points at its parent)."""
        for n in range(len(path), -1, -1):
            line = self.lines.get(tuple(path[:n]))
            if line is not None:
                return line
        return None


class _TooBig(Exception):
    pass


def _plain(node: Any, path: Path, lines: dict[Path, int], budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise _TooBig(path)
    if isinstance(node, CommentedMap):
        out: dict[Any, Any] = {}
        for key in node:
            child = (*path, key if isinstance(key, str | int) else str(key))
            try:
                lines.setdefault(child, node.lc.key(key)[0] + 1)
            except (KeyError, TypeError, AttributeError):  # merged keys (<<) carry no position of their own
                pass
            out[key] = _plain(node[key], child, lines, budget, depth + 1)
        return out
    if isinstance(node, CommentedSeq):
        items = []
        for i, item in enumerate(node):
            child = (*path, i)
            try:
                lines.setdefault(child, node.lc.item(i)[0] + 1)
            except (KeyError, TypeError, AttributeError):
                pass
            items.append(_plain(item, child, lines, budget, depth + 1))
        return items
    if isinstance(node, str):
        return str(node)  # drop ruamel's scalar-string subclasses
    if isinstance(node, bool):
        return bool(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if node is None:
        return None
    if isinstance(node, bytes | AbstractSet):
        return node  # !!binary, !!set: no spec field takes them, so validation names the field (as text they passed)
    return str(node)  # dates, other tagged scalars: as text, which a string field takes as written


def parse_yaml(text: str, file: str) -> YamlDoc:
    """Parse spec text; raise ``SpecError`` for anything that is not a sane YAML mapping."""
    if len(text.encode("utf-8", "replace")) > MAX_FILE_BYTES:
        raise SpecError(file, [Diagnostic(path=(), message=f"file is larger than {MAX_FILE_BYTES} bytes",
                                          hint="a spec is a short YAML document; check you passed the right file")])
    if not text.strip():
        raise SpecError(file, [Diagnostic(path=(), message="the spec is empty",
                                          hint="start from one of the example specs (dora ships specs/*.yaml)")])
    yaml = YAML(typ="rt", pure=True)
    try:
        root = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise SpecError(file, [Diagnostic(path=(), line=line, message=f"not valid YAML: {problem}",
                                          hint="check indentation and quoting near that line")]) from None
    except YAMLError as exc:
        raise SpecError(file, [Diagnostic(path=(), message=f"not valid YAML: {exc}",
                                          hint="check the file is a YAML document")]) from None
    except RecursionError:
        raise SpecError(file, [Diagnostic(path=(), message="YAML nesting is too deep",
                                          hint=f"a spec nests at most {MAX_DEPTH} levels")]) from None
    if root is None:
        raise SpecError(file, [Diagnostic(path=(), message="the spec is empty (only comments or blank lines)",
                                          hint="start from one of the example specs (dora ships specs/*.yaml)")])
    if not isinstance(root, CommentedMap):
        kind = "a list" if isinstance(root, CommentedSeq) else f"a {type(root).__name__} scalar"
        raise SpecError(file, [Diagnostic(path=(), line=1, message=f"the spec must be a YAML mapping, got {kind}",
                                          hint="top-level keys are name, model, cluster, workload, ...")])
    lines: dict[Path, int] = {(): 1}
    try:
        data = _plain(root, (), lines, [MAX_NODES], 0)
    except _TooBig as exc:
        path: Path = exc.args[0][:1]  # the top-level key whose value explodes; deeper paths are noise
        raise SpecError(file, [Diagnostic(
            path=path, line=YamlDoc({}, lines).line_of(path),
            message=f"the document expands to more than {MAX_NODES} nodes or {MAX_DEPTH} levels "
                    "(YAML aliases referencing each other?)",
            hint="remove the recursive/exponential aliases; write the values out")]) from None
    return YamlDoc(data=data, lines=lines)
