"""The spec language: load, validate and resolve a dora YAML spec into typed, frozen data.

``load_spec(path)`` returns a ``ResolvedSpec`` (the validated ``Spec`` plus the resolved model architecture
and length distributions) or raises ``SpecError`` carrying every problem found, each with its YAML path, line
and a fix.
"""

from dora.spec.diagnostics import Diagnostic, SpecError
from dora.spec.loader import ResolvedSpec, load_spec, load_spec_text, slug
from dora.spec.models import ALL_MODES, Spec

__all__ = ["ALL_MODES", "Diagnostic", "ResolvedSpec", "Spec", "SpecError", "load_spec", "load_spec_text", "slug"]
