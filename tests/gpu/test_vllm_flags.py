"""The generated vLLM arguments parse with vLLM's own parser and build its EngineArgs (where vLLM is installed).

Elsewhere the same arguments are checked against the recorded flag list (tests/unit/test_lower_vllm.py).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

# The example plans live beside the unit tests; this tier shares them rather than keeping a second copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_lower_plans import CPU_SPECS, EXAMPLE_SPECS, example_plan, load_example  # noqa: E402

from dora.lower import render_launch  # noqa: E402

pytestmark = pytest.mark.gpu
vllm_arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason="vllm not installed (GPU extra)")


def _parser():
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
    except ImportError:  # older vLLM keeps it in vllm.utils
        from vllm.utils import FlexibleArgumentParser as Parser
    return vllm_arg_utils.EngineArgs.add_cli_args(Parser())


@pytest.mark.parametrize("stem", [s for s in EXAMPLE_SPECS if s not in CPU_SPECS])
def test_vllm_parses_the_generated_arguments(stem: str) -> None:
    resolved = load_example(stem)
    files = render_launch(resolved, example_plan(resolved, stem))
    args = json.loads(files["launch/vllm/engine_args.json"])
    if "launch/vllm/serve.args" not in files:
        pytest.skip(f"{stem} names no checkpoint, so there is no serve line")
    argv = shlex.split(files["launch/vllm/serve.args"])
    model, flags = argv[2], argv[3:]
    parsed = _parser().parse_args(["--model", model, *flags])
    engine = vllm_arg_utils.EngineArgs.from_cli_args(parsed)
    for name, value in args.items():
        assert getattr(engine, name) == value, name
    vllm_arg_utils.EngineArgs(**args)  # the JSON form builds the same dataclass
