"""JSON Schema of the spec language (for editors and for validating specs outside dora)."""

from __future__ import annotations

from typing import Any

from dora import __version__
from dora.spec.models import Spec


def spec_json_schema() -> dict[str, Any]:
    schema = Spec.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$comment"] = f"dora {__version__} spec language"
    return schema
