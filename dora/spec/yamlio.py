"""Reading YAML with line numbers, safely.

``read_yaml`` parses with ruamel's round-trip loader (no arbitrary object construction) and converts the
result to plain Python data while recording the 1-based line of every key and list item. The conversion walks
aliases by value, so a "billion laughs" document would expand exponentially: the walk counts the nodes it
produces and stops at ``MAX_NODES``, which bounds time and memory whatever the input.

Scalars are built by ``_SpecConstructor``, which never fails on content: a spec has no date fields, so a scalar
YAML reads as a date (``name: 2024-02-30``) stays the text as written, and a scalar its tag cannot build
(``!!int "abc"``, ``!!bool maybe``, an integer of thousands of digits) becomes a ``_BadScalar`` that the walk
reports at its YAML path and line, alongside every other problem of the spec (``YamlDoc.problems``). So is every
tag outside the YAML core schema (``!env``, ``!!env``, ``!!python/int``, ``!!binary``, ``!e!include`` under a
``%TAG`` directive, ``!<tag:example.com,2000:x>``): dora expands none, and a value read without its tag is not
what its author meant.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq, TaggedScalar
from ruamel.yaml.constructor import ConstructorError, DuplicateKeyError, RoundTripConstructor
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode
from ruamel.yaml.reader import ReaderError

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
    problems: tuple[Diagnostic, ...] = ()
    """Scalars the YAML could not build (``!!int "abc"``), and tags dora does not read (``!env``), each at its path and
    line; in ``data`` as their text."""
    str_tagged: Mapping[Path, str] = field(default_factory=dict)
    """Scalars that are text because of an explicit ``!!str`` (``nodes: !!str 1``): what to remove, for a message."""

    def line_of(self, path: Path) -> int | None:
        """Line of the deepest known prefix of ``path`` (an unknown leaf points at its parent)."""
        for n in range(len(path), -1, -1):
            line = self.lines.get(tuple(path[:n]))
            if line is not None:
                return line
        return None


class _TooBig(Exception):
    pass


_CORE = "tag:yaml.org,2002:"
_MERGE = _CORE + "merge"
_NODE_KINDS: dict[str, tuple[Any, str]] = {
    **{t: (ScalarNode, "a scalar") for t in ("int", "float", "bool", "null", "str")},
    "map": (MappingNode, "a mapping"),
    "seq": (SequenceNode, "a list"),
}
"""The tags dora reads, the YAML core schema's, and the node each builds from: ``!!int {a: 1}`` would otherwise fail
deep inside ruamel."""
_READ_TAGS = frozenset(_CORE + short for short in _NODE_KINDS)
_UNREAD = frozenset({"binary", "timestamp", "set", "omap", "pairs"})
"""YAML 1.1 tags ruamel builds (bytes, dates, sets, ordered maps) that no spec field takes: reported like any other tag
dora does not read. A date written without a tag is read as its text (no spec field is a date)."""
_UNREGISTERED = "tag:dora,2026:unread"
"""A tag no constructor is registered for: ruamel builds a node under it as it builds any unknown tag's, keeping the
tag written (``node.ctag``) on the value for ``_plain`` to report."""
_WANTED = {"int": "an integer", "float": "a number", "bool": "true or false"}
_HINTS = {
    "int": "write a whole number such as 8 (the !!int tag is not needed)",
    "float": "write a number such as 0.5 (the !!float tag is not needed)",
    "bool": "write true or false (the !!bool tag is not needed)",
}


@dataclass(frozen=True)
class _BadScalar:
    """A node its tag could not build: reported by ``_plain`` at the node's path, kept in the data as its text."""

    text: str
    message: str
    hint: str
    line: int


class _SpecConstructor(RoundTripConstructor):
    """ruamel's round-trip constructor, except that bad content becomes a ``_BadScalar`` instead of an exception
    (ruamel raises ValueError, KeyError or IndexError from ``!!int "abc"``, ``!!bool maybe``, ``!!float ""``), and
    dates stay text."""

    def construct_non_recursive_object(self, node: Any, tag: str | None = None) -> Any:
        tag = node.tag if tag is None else tag
        short = tag[len(_CORE):] if isinstance(tag, str) and tag.startswith(_CORE) else None
        if short == "timestamp" and node.ctag.handle is None and isinstance(node, ScalarNode):
            return str(node.value)  # a date YAML resolved, with no tag written: the text as written, valid date or not
        if short in _UNREAD:
            return super().construct_non_recursive_object(node, _UNREGISTERED)
        if short not in _NODE_KINDS:
            return super().construct_non_recursive_object(node, tag)
        kind, what = _NODE_KINDS[short]
        if not isinstance(node, kind):
            return self._bad(node, f"!!{short} needs {what}, got {_node_kind(node)}", f"remove the !!{short} tag")
        try:
            return super().construct_non_recursive_object(node, tag)
        except (YAMLError, ValueError, LookupError, TypeError, AttributeError, ArithmeticError) as exc:
            if kind is not ScalarNode:
                raise
            return self._bad_scalar(node, short, exc)

    def _bad_scalar(self, node: Any, short: str, exc: Exception) -> _BadScalar:
        text = str(node.value)
        digits = sum(c.isdigit() for c in text)
        if "Exceeds the limit" in str(exc):  # Python's int() refuses more than 4300 digits (CVE-2020-10735)
            return self._bad(node, f"a number of {digits:,} digits is too long to read",
                             "no spec field takes a number this large; write a smaller one")
        shown = text if len(text) <= 40 else text[:37] + "..."
        implicit = node.style is None and self.resolver.resolve(ScalarNode, text, (True, False)) == node.tag
        written = shown if implicit else f'!!{short} "{shown}"'
        wanted = _WANTED.get(short, f"a valid !!{short} value")
        reason = getattr(exc, "problem", None) or str(exc)
        detail = f" ({reason})" if short not in _WANTED and reason else ""
        return self._bad(node, f"{written} is not {wanted}{detail}", _HINTS.get(short, f"remove the !!{short} tag"))

    def check_mapping_key(self, node: Any, key_node: Any, mapping: Any, key: Any, value: Any) -> bool:
        try:
            hash(key)  # ruamel lets through a tuple key that holds a list (`[[1, 2]]: x`), then fails on it
        except TypeError:
            raise ConstructorError("while constructing a mapping", node.start_mark, "found unhashable key",
                                   key_node.start_mark) from None
        return bool(super().check_mapping_key(node, key_node, mapping, key, value))

    def construct_mapping(self, node: Any, maptyp: Any, deep: bool = False) -> Any:  # type: ignore[override]
        # (ruamel's round-trip signature, which differs from its base classes')
        merge = next((key for key, _ in node.value if key.tag == _MERGE), None)
        if merge is not None:  # ruamel drops the `<<` entry; its line is where the keys it merges are reported
            maptyp.dora_merge_line = merge.start_mark.line + 1
        return super().construct_mapping(node, maptyp, deep)

    @staticmethod
    def _bad(node: Any, message: str, hint: str) -> _BadScalar:
        text = node.value if isinstance(node, ScalarNode) else ""
        return _BadScalar(text=str(text), message=message, hint=hint, line=node.start_mark.line + 1)


def _unread_tag(node: Any) -> str | None:
    """The tag written on ``node`` as written (``!env``, ``!!env``, ``!!python/int``, ``!e!include``,
    ``!<tag:example.com,2000:foo>``), or None if it has none or one dora reads (``!!str``, ``!!int``, ...)."""
    tag: Any = getattr(node, "tag", None)
    value = getattr(tag, "value", None)
    if not isinstance(value, str) or value in _READ_TAGS:
        return None
    return f"{tag.handle}{tag.suffix}" if tag.handle else f"!<{tag.suffix}>"


def _tag_problem(path: Path, line: int | None, shown: str, tag: str) -> Diagnostic:
    return Diagnostic(path=path, line=line, message=f"{shown} carries the YAML tag {tag}, which dora does not read",
                      hint=f"remove {tag}: a spec holds plain values (dora expands no !include, !env or other tags)")


def _key_line(mapping: CommentedMap, key: Any) -> int | None:
    """The 1-based line of ``key`` in ``mapping``; for a key merged in (``<<: {...}`` or ``<<: *base``), the line of
    the ``<<`` entry."""
    try:
        return int(mapping.lc.key(key)[0]) + 1
    except (KeyError, TypeError, AttributeError):
        return getattr(mapping, "dora_merge_line", None)


def _node_kind(node: Any) -> str:
    return {ScalarNode: "a scalar", MappingNode: "a mapping", SequenceNode: "a list"}.get(type(node), "a node")


@dataclass
class _Walk:
    """What ``_plain`` records on its way through the document."""

    lines: dict[Path, int]
    problems: list[Diagnostic]
    str_tagged: dict[Path, str]
    budget: int = MAX_NODES


def _plain(node: Any, path: Path, depth: int, walk: _Walk) -> Any:
    lines, problems = walk.lines, walk.problems
    walk.budget -= 1
    if walk.budget < 0 or depth > MAX_DEPTH:
        raise _TooBig(path)
    if isinstance(node, _BadScalar):
        problems.append(Diagnostic(path=path, line=node.line, message=node.message, hint=node.hint))
        return node.text
    tag = _unread_tag(node)
    if tag is not None:  # `!env NAME`, `!include x.yaml`: reported; a scalar is kept as its text, a mapping walked
        shown = f"`{tag} {node.value}`".replace(" `", "`") if isinstance(node, TaggedScalar) else \
            "this mapping" if isinstance(node, CommentedMap) else "this list"
        problems.append(_tag_problem(path, lines.get(path), shown, tag))
        if isinstance(node, TaggedScalar):
            return str(node.value)
    if isinstance(node, CommentedMap):
        out: dict[Any, Any] = {}
        for key in node:
            if isinstance(key, _BadScalar):  # a key its tag could not build: as its text, reported at the key
                problems.append(Diagnostic(path=(*path, key.text), line=key.line, message=key.message, hint=key.hint))
                out[key.text] = _plain(node[key], (*path, key.text), depth + 1, walk)
                continue
            key_tag = _unread_tag(key)
            # `!foo name: x`: read as its text, reported; `!!str name: x`: its text
            name = str(key.value) if isinstance(key, TaggedScalar) else key
            child = (*path, name if isinstance(name, str | int) else str(name))
            line = _key_line(node, key)
            if line is not None:
                lines.setdefault(child, line)
            if key_tag is not None:
                problems.append(_tag_problem(child, line, f"the key `{key_tag} {name}`", key_tag))
            out[name] = _plain(node[key], child, depth + 1, walk)
        return out
    if isinstance(node, CommentedSeq):
        items = []
        for i, item in enumerate(node):
            child = (*path, i)
            try:
                lines.setdefault(child, node.lc.item(i)[0] + 1)
            except (KeyError, TypeError, AttributeError):
                pass
            items.append(_plain(item, child, depth + 1, walk))
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
    if isinstance(node, TaggedScalar):  # `!!str 5`: text because of its tag, which a message about it names
        walk.str_tagged[path] = "the !!str tag" + (" and quotes" if node.style in ("'", '"') else "")
        return str(node.value)
    return str(node)  # any other scalar ruamel builds: as text


_LINE_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")
"""What ruamel counts as a line break (its marks' lines; a CR-only file has no \n at all)."""

_SCALAR_KINDS = {int: "a number", float: "a number", bool: "true or false", str: "a single string"}
"""How a top-level value that is not a mapping reads to the spec's author."""


def parse_yaml(text: str, file: str) -> YamlDoc:
    """Parse spec text; raise ``SpecError`` for anything that is not a sane YAML mapping."""
    if len(text.encode("utf-8", "replace")) > MAX_FILE_BYTES:
        raise SpecError(file, [Diagnostic(path=(), message=f"file is larger than {MAX_FILE_BYTES} bytes",
                                          hint="a spec is a short YAML document; check you passed the right file")])
    if not text.strip():
        raise SpecError(file, [Diagnostic(path=(), message="the spec is empty",
                                          hint="start from one of the example specs (dora ships specs/*.yaml)")])
    yaml = YAML(typ="rt", pure=True)
    yaml.Constructor = _SpecConstructor
    try:
        root = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        hint = "check indentation and quoting near that line"
        if isinstance(exc, DuplicateKeyError):  # problem: found duplicate key "name" with value ... (original ...)
            key = problem.split('"')[1] if problem.count('"') >= 2 else "the key"
            hint = f"remove one of the two `{key}:` entries of that mapping"
        raise SpecError(file, [Diagnostic(path=(), line=line, message=f"not valid YAML: {problem}",
                                          hint=hint)]) from None
    except ReaderError as exc:  # a character YAML does not allow: ruamel gives its position, not its line
        if not isinstance(exc.character, int) or not isinstance(exc.position, int):
            raise SpecError(file, [Diagnostic(path=(), message=f"not valid YAML: {exc}",
                                              hint="check the file is a YAML document")]) from None
        line = len(_LINE_BREAK.findall(text, 0, exc.position)) + 1
        raise SpecError(file, [Diagnostic(path=(), line=line,
                                          message=f"not valid YAML: the character U+{exc.character:04X} is not allowed "
                                                  "in a YAML document",
                                          hint="remove it, or write it as an escape (e.g. \\x07) inside a "
                                               "double-quoted string")]) from None
    except YAMLError as exc:
        raise SpecError(file, [Diagnostic(path=(), message=f"not valid YAML: {exc}",
                                          hint="check the file is a YAML document")]) from None
    except RecursionError:
        raise SpecError(file, [Diagnostic(path=(), message="YAML nesting is too deep",
                                          hint=f"a spec nests at most {MAX_DEPTH} levels")]) from None
    except (TypeError, AttributeError, ValueError, LookupError, ArithmeticError) as exc:
        # ruamel's own failures on odd structure (a !!pairs list as a mapping key); scalars never get here
        raise SpecError(file, [Diagnostic(path=(), message=f"not valid YAML for a spec: {type(exc).__name__}: {exc}",
                                          hint="write plain keys and values: no `? ` complex keys, no tags on "
                                               "lists or mappings")]) from None
    if root is None:
        raise SpecError(file, [Diagnostic(path=(), message="the spec is empty (only comments or blank lines)",
                                          hint="start from one of the example specs (dora ships specs/*.yaml)")])
    if not isinstance(root, CommentedMap):
        kind = "a list" if isinstance(root, CommentedSeq) else \
            "a scalar" if isinstance(root, _BadScalar) else _SCALAR_KINDS.get(type(root), "a single value")
        raise SpecError(file, [Diagnostic(path=(), line=1, message=f"the spec must be a YAML mapping, got {kind}",
                                          hint="top-level keys are name, model, cluster, workload, ...")])
    walk = _Walk(lines={(): 1}, problems=[], str_tagged={})
    try:
        data = _plain(root, (), 0, walk)
    except _TooBig as exc:
        path: Path = exc.args[0][:1]  # the top-level key whose value explodes; deeper paths are noise
        raise SpecError(file, [Diagnostic(
            path=path, line=YamlDoc({}, walk.lines).line_of(path),
            message=f"the document expands to more than {MAX_NODES} nodes or {MAX_DEPTH} levels of nesting "
                    "(deeply nested lists or mappings, or aliases that expand)",
            hint="write the values out plainly: a spec's fields nest a few levels at most")]) from None
    return YamlDoc(data=data, lines=walk.lines, problems=tuple(walk.problems), str_tagged=walk.str_tagged)
