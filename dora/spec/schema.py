"""JSON Schema of the spec language (for editors and for validating specs outside dora)."""

from __future__ import annotations

from typing import Any

from dora import __version__
from dora.spec.models import Spec


def spec_json_schema() -> dict[str, Any]:
    schema = Spec.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    # JSON Schema's integer is any number with a zero fractional part, so 1.0 is one; dora reads YAML, where 1.0 is a
    # float, and refuses it for an integer field. No keyword tells 1.0 from 1 (`multipleOf: 1` accepts both): say so.
    schema["$comment"] = (f"dora {__version__} spec language. A field of type integer takes a whole number written "
                          "without a decimal point or exponent: dora refuses 1.0 or 1e3 there, which this schema's "
                          "integer type accepts.")
    return schema
