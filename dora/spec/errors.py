"""Turning pydantic validation errors into located diagnostics with did-you-mean and a fix."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from pydantic import BaseModel, ValidationError
from ruamel.yaml.nodes import ScalarNode
from ruamel.yaml.resolver import VersionedResolver

from dora.spec.diagnostics import DID_YOU_MEAN_CUTOFF, Diagnostic, Path, did_you_mean
from dora.spec.models import UNION_TAGS, PinnedPlacement, Spec
from dora.spec.yamlio import YamlDoc


def _model_at(path: Path) -> type[BaseModel] | None:
    """The pydantic model class that validates the mapping at ``path`` (for listing valid keys)."""
    model: type[BaseModel] | None = Spec
    for part in path:
        if model is None or not isinstance(part, str):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        if model is Spec and part == "placement":
            model = PinnedPlacement
            continue
        model = _first_model(field.annotation)
    return model


def closest_field(path: Path) -> str | None:
    """The field of the mapping at ``path[:-1]`` that the key ``path[-1]`` (which names none) is closest to, as
    ``did_you_mean`` picks it; None when none is close or the key is not text."""
    parent = _model_at(path[:-1])
    if parent is None or not path or not isinstance(path[-1], str):
        return None
    close = difflib.get_close_matches(path[-1], list(parent.model_fields), n=1, cutoff=DID_YOU_MEAN_CUTOFF)
    return close[0] if close else None


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _clean(loc: tuple[Any, ...]) -> Path:
    return tuple(p for p in loc if not (isinstance(p, str) and p in UNION_TAGS and p != loc[0]))


def _describe(value: Any) -> str:
    """``value`` as the spec's author wrote it: YAML's spelling for null and booleans, the kind of a collection."""
    if value is None:
        return "null (an empty value)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, AbstractSet):  # ruamel's own collections are not all set, list or dict subclasses
        return "a set"
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str() limit (a hex literal can be that long)
        return f"an integer of {int(value.bit_length() * 0.30103) + 1:,} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def _without(value: Any, path: Path, doc: YamlDoc, *kinds: str) -> str:
    """" without quotes" when ``value`` is text that YAML would have read as one of ``kinds`` (int, float, bool)
    unquoted: the quotes (``nodes: "2"``) are what made it a string; " without the !!str tag" when the tag did
    (``nodes: !!str 2``). ``2:0`` or ``two`` is text however it was written: ""."""
    if not isinstance(value, str):
        return ""
    tag = str(VersionedResolver().resolve(ScalarNode, value, (True, False)))  # a ruamel Tag, not a str
    if tag not in {f"tag:yaml.org,2002:{kind}" for kind in kinds}:
        return ""
    return f" without {doc.str_tagged.get(path, 'quotes')}"


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _bounds(path: Path) -> str:
    """The bounds of the number field at ``path`` (``> 0 and <= 1000``), as its type states them; '' if none."""
    parent = _model_at(path[:-1])
    field = parent.model_fields.get(str(path[-1])) if parent and path else None
    if field is None:
        return ""
    constraints = list(field.metadata)
    for arg in getattr(field.annotation, "__args__", ()):  # `Annotated[float, Field(le=...)] | None`
        for info in getattr(arg, "__metadata__", ()):
            constraints += getattr(info, "metadata", [])
    said = [f"{sign} {getattr(c, name):g}" for c in constraints for name, sign in _BOUNDS if hasattr(c, name)]
    return " and ".join(said)


def _key_description(key: Any) -> str:
    """A mapping key that is not text, as its author wrote it (pydantic gives the key itself)."""
    if key is None:
        return "the key `~` (null, or nothing before the colon)"
    if isinstance(key, bool):
        return f"the key `{'true' if key else 'false'}` (YAML reads it as a boolean)"
    if isinstance(key, int | float):
        return f"the key `{_describe(key)}` (YAML reads it as a number)"
    if isinstance(key, tuple | list):
        return "a `? [...]` key (a list)"
    if isinstance(key, Mapping):  # ruamel's CommentedKeyMap, from `? {a: 1}`
        return "a `? {...}` key (a mapping)"
    return f"the key {_describe(key)}"


_KEY_ERRORS = frozenset({"extra_forbidden", "invalid_key"})
"""A key that names no field: unknown whatever its value."""


def stray_keys(exc: ValidationError) -> list[Path] | None:
    """The paths, as keys of the data, of the keys that name no field (``runtime.sed``, ``true:``), when they are all
    that validation refused; None when it refused something else."""
    out: list[Path] = []
    for err in exc.errors(include_url=False):
        if err["type"] not in _KEY_ERRORS:
            return None
        path = _clean(tuple(err["loc"]))
        out.append(path if err["type"] == "extra_forbidden" else (*path[:-1], err["input"]))  # pydantic spells the key
    return out


def diagnostics_from_validation(exc: ValidationError, doc: YamlDoc, file: str,
                                unbuilt: Collection[Path] = ()) -> list[Diagnostic]:
    """Every error of ``exc`` as a located diagnostic. A value under a path in ``unbuilt`` (a scalar YAML could not
    build, which yamlio reports) is in the data as its text: what validation says about that text is left out, but not
    that its key names no field."""
    out: list[Diagnostic] = []
    seen: set[tuple[Path, str]] = set()
    for err in exc.errors(include_url=False):
        path = _clean(tuple(err["loc"]))
        kind = err["type"]
        if kind not in _KEY_ERRORS and any(path[:len(u)] == u for u in unbuilt):
            continue
        value = err.get("input")
        ctx = err.get("ctx") or {}
        line = doc.line_of(path)
        if kind == "invalid_key":  # `true: 3`, `~: 3`, `3: x`, `? [a, b]`: YAML built a key that is not text
            path = path[:-1]  # reported at the mapping; the line is the key's (yamlio records it as pydantic spells it)
            parent = _model_at(path)
            valid = sorted(parent.model_fields) if parent else []
            msg = f"{_key_description(value)} is not a field name"
            hint = (f"valid keys here: {', '.join(valid)}" if valid else "write a field name") + \
                " (`dora schema` describes them all)"
        elif kind == "extra_forbidden":
            key = str(path[-1])
            parent = _model_at(path[:-1])
            valid = sorted(parent.model_fields) if parent else []
            msg = f"unknown key '{key}'" + did_you_mean(key, valid)
            hint = f"valid keys here: {', '.join(valid)}" if valid else "remove the key"
        elif kind == "missing":
            msg = "required field is missing"
            parent = _model_at(path[:-1])
            field = parent.model_fields.get(str(path[-1])) if parent else None
            doc_text = (field.description or "").split("\n")[0] if field else ""
            hint = f"add `{path[-1]}:`" + (f" — {doc_text}" if doc_text else "")
        elif kind == "literal_error":
            expected = str(ctx.get("expected", ""))
            options = [o.strip().strip("'") for o in expected.replace(" or ", ", ").split(",")]
            msg = f"{_describe(value)} is not allowed" + (did_you_mean(str(value), options) if isinstance(value, str) else "")
            hint = f"use one of: {', '.join(o for o in options if o)}"
        elif kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
            bound = next(iter(ctx.values()), "?")
            rel = {"greater_than": ">", "greater_than_equal": ">=", "less_than_equal": "<=", "less_than": "<"}[kind]
            msg = f"must be {rel} {bound}, got {_describe(value)}"
            hint = f"set a value {rel} {bound}"
        elif kind in ("int_type", "int_parsing", "int_from_float"):
            msg = f"expected an integer, got {_describe(value)}"
            hint = f"write a whole number{_without(value, path, doc, 'int', 'float')}, e.g. 8"
        elif kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
            bounds = _bounds(path)  # an integer of 309 digits or more: beyond a float, so pydantic says "not a number"
            msg = f"must be {bounds}, got {_describe(value)}" if bounds else \
                f"is out of range, got {_describe(value)} (beyond any float, about 1.8e308)"
            hint = f"set a value {bounds}" if bounds else "write a smaller number"
        elif kind in ("float_type", "float_parsing"):
            msg = f"expected a number, got {_describe(value)}"
            hint = f"write a number{_without(value, path, doc, 'int', 'float')}, e.g. 0.5"
        elif kind == "finite_number":
            msg = f"must be a finite number, got {_describe(value)}"
            hint = "write a finite number, e.g. 0.5"
        elif kind in ("bool_type", "bool_parsing"):
            msg = f"expected true or false, got {_describe(value)}"
            hint = f"write true or false{_without(value, path, doc, 'bool')}"
        elif kind in ("string_type",):
            msg = f"expected a string, got {_describe(value)}"
            hint = "quote the value"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            msg = f"expected a mapping, got {_describe(value)}"
            model = _model_at(path)
            hint = f"write a mapping with keys: {', '.join(sorted(model.model_fields))}" if model else "write a mapping"
        elif kind in ("string_too_short", "string_too_long"):
            msg = err["msg"].lower()
            hint = "use a non-empty name of at most 128 characters"
        elif kind == "string_pattern_mismatch":  # `name: "   "`: the only pattern, at least one visible character
            msg = f"is blank, got {_describe(value)}"
            hint = "write a name with at least one visible character (at most 128 characters)"
        elif kind == "string_unicode":
            msg = "is not valid text (it holds a lone UTF-16 surrogate, such as an escaped \\ud800)"
            hint = "remove the \\u escape, or write the character itself"
        elif kind == "union_tag_invalid" or kind == "union_tag_not_found":
            msg = f"expected `auto` or a mapping, got {_describe(value)}"
            hint = "write `placement: auto` or pin fields under placement.rollout / placement.train"
        else:
            msg = err["msg"]
            hint = "see `dora schema` for the field's type"
        seen_key = (path, msg)
        if seen_key in seen:
            continue
        seen.add(seen_key)
        out.append(Diagnostic(path=path, line=line, message=msg, hint=hint, file=file))
    return out
