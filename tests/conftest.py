"""Shared pytest options: `--update-golden` rewrites golden files instead of comparing against them."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tear down the one-rank process group the Megatron trainer tests start (``init_single_rank``) before the
    interpreter exits, rather than leave its destructor to interpreter shutdown."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files under tests/golden/ from the current output")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


def assert_golden(path: Path, actual: str, update: bool) -> None:
    """Compare ``actual`` with the golden file at ``path`` (or rewrite it with --update-golden)."""
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
        return
    assert path.exists(), f"golden file {path} missing: run pytest --update-golden"
    expected = path.read_text(encoding="utf-8")
    assert actual == expected, f"{path} differs from the output; if the change is intended, run pytest --update-golden"


@pytest.fixture
def terminal_sigint():
    """SIGINT's default disposition (Python's KeyboardInterrupt) for the test, as a foreground process in a terminal
    has it: a runner started in the background of a non-interactive shell (`bash .ci/run &`) ignores SIGINT, its
    children inherit that, and Python then installs no handler, so a test that sends itself SIGINT saw nothing."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def ctx():
    """The cost-model context `dora calibrate` fits for the local spec (tests of the calibration fits)."""
    from dora.calibrate import ModelContext
    from dora.planning import search_inputs
    from dora.spec import load_spec

    inputs = search_inputs(load_spec(str(REPO / "specs/local-tiny.yaml")))
    return ModelContext(arch=inputs.arch, accelerator=inputs.accelerator, dtype_bytes=inputs.dtype_bytes,
                        rollout_weight_bytes=inputs.rollout_weight_bytes,
                        extra_forward_passes=inputs.extra_forward_passes, optimizer_steps=inputs.optimizer_steps,
                        micro_batch_tokens=8192,
                        accelerators_per_node=inputs.accelerators_per_node)
