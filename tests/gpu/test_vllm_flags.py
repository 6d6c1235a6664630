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


GPU_SPECS = [s for s in EXAMPLE_SPECS if s not in CPU_SPECS]
SERVED_SPECS = [s for s in GPU_SPECS if load_example(s).spec.model.checkpoint]
"""The examples that name a checkpoint: only those get a serve line (a vLLM command needs a model to load)."""


def _vllm_files(stem: str) -> dict[str, str]:
    resolved = load_example(stem)
    return render_launch(resolved, example_plan(resolved, stem))


@pytest.mark.parametrize("stem", GPU_SPECS)
def test_vllm_builds_its_engine_args_from_the_generated_json(stem: str) -> None:
    files = _vllm_files(stem)
    args = json.loads(files["launch/vllm/engine_args.json"])
    engine = vllm_arg_utils.EngineArgs(**args)  # an argument vLLM does not have is a TypeError
    for name, value in args.items():
        assert getattr(engine, name) == value, name
    assert ("launch/vllm/serve.args" in files) == (stem in SERVED_SPECS)


@pytest.mark.parametrize("stem", SERVED_SPECS)
def test_vllm_parses_the_generated_serve_line(stem: str) -> None:
    files = _vllm_files(stem)
    args = json.loads(files["launch/vllm/engine_args.json"])
    argv = shlex.split(files["launch/vllm/serve.args"])
    model, flags = argv[2], argv[3:]
    parsed = _parser().parse_args(["--model", model, *flags])
    engine = vllm_arg_utils.EngineArgs.from_cli_args(parsed)
    for name, value in args.items():
        assert getattr(engine, name) == value, name
