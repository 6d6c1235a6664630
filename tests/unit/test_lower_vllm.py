"""vLLM arguments use only flags vLLM's engine parser defines (the recorded list, tests/data/vllm_engine_flags.txt)
and the `vllm serve` line says the same as the engine-args JSON."""

from __future__ import annotations

import json
import shlex

import pytest
from test_lower_plans import CPU_SPECS, EXAMPLE_SPECS, REPO, example_plan, load_example

from dora.lower import render_launch
from dora.lower.vllm import serve_argv

RECORDED = {line.strip() for line in (REPO / "tests/data/vllm_engine_flags.txt").read_text().splitlines()
            if line.startswith("--")}
VLLM_SPECS = [s for s in EXAMPLE_SPECS if s not in CPU_SPECS]


def test_recorded_list_holds_the_flags_every_engine_needs() -> None:
    assert {"--tensor-parallel-size", "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--dtype",
            "--seed", "--enable-expert-parallel", "--data-parallel-size"} <= RECORDED
    assert len(RECORDED) > 100


@pytest.mark.parametrize("stem", VLLM_SPECS)
def test_engine_args_are_recorded_vllm_flags(stem: str) -> None:
    resolved = load_example(stem)
    files = render_launch(resolved, example_plan(resolved, stem))
    args = json.loads(files["launch/vllm/engine_args.json"])
    flags = {"--" + name.replace("_", "-") for name in args}
    assert flags - RECORDED == set()
    if "launch/vllm/serve.args" in files:
        argv = shlex.split(files["launch/vllm/serve.args"])
        assert argv == serve_argv(args)
        assert {a for a in argv if a.startswith("--")} <= RECORDED


def test_a_flag_vllm_lacks_would_be_caught() -> None:
    assert "--max-model-length" not in RECORDED and "--tp" not in RECORDED
