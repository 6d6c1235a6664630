"""Lowering: turn a Plan into the launch artifacts under ``DIR/launch/`` — nothing else.

``build_context`` computes every value (in Python: shell quoting with ``shlex.quote``, JSON with ``json.dumps``);
the jinja2 templates in ``templates/`` only place those pre-computed strings, rendered with ``StrictUndefined``.
``render_launch`` returns the artifacts as ``{relative path: text}``; ``write_launch_artifacts`` writes them
atomically. Lowering never plans: an inconsistent Plan raises ``LoweringError`` instead of being repaired.

Modules: ``ray`` (job submission body, placement groups), ``vllm`` (engine arguments), ``megatron``
(megatron-core configs and Megatron-LM flags), ``runtime`` (the RuntimeConfig), ``context`` (the typed context
the templates see), ``render`` (jinja2 environment, rendering, atomic writing).
"""

from dora.lower.context import LaunchContext, build_context
from dora.lower.errors import LoweringError
from dora.lower.render import render_launch, write_launch_artifacts

__all__ = ["LaunchContext", "LoweringError", "build_context", "render_launch", "write_launch_artifacts"]
