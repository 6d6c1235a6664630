"""The planner's plans for the example specs, shared by the lowering tests (planned once per session)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from dora.planning import Planned, make_plan
from dora.spec import ResolvedSpec, load_spec
from planner.plan import Plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SPECS = sorted(p.stem for p in (REPO / "specs").glob("*.yaml"))
CPU_SPECS = [s for s in EXAMPLE_SPECS if s.startswith("local-tiny")]
"""The examples on the cpu accelerator (dora's embedded runtime): no vLLM or Megatron launch files."""


def load_example(stem: str) -> ResolvedSpec:
    return load_spec(f"specs/{stem}.yaml") if (Path.cwd() / "specs").is_dir() else \
        load_spec(str(REPO / "specs" / f"{stem}.yaml"))


@cache
def _planned_for(stem: str, spec_hash: str) -> Planned:
    return make_plan(load_example(stem))


def example_planned(stem: str) -> Planned:
    """``make_plan`` of example spec ``stem``: its plan and the search's outcome (cached for the whole run: planning the
    big specs takes seconds, and several test modules read the same plans; treat it as read-only)."""
    return _planned_for(stem, load_example(stem).spec_hash)


def example_plan(resolved: ResolvedSpec, stem: str) -> Plan:
    """The planner's plan for example spec ``stem`` (cached, ``example_planned``) or for ``resolved`` when it differs."""
    if resolved.spec_hash == load_example(stem).spec_hash:
        return example_planned(stem).plan
    return make_plan(resolved).plan


@pytest.mark.parametrize("stem", EXAMPLE_SPECS)
def test_every_example_spec_has_a_plan_that_fits_its_cluster(stem: str) -> None:
    resolved = load_example(stem)
    plan = example_plan(resolved, stem)
    r, t = plan.rollout, plan.train
    assert r.replicas * r.accelerators_per_replica == r.accelerators
    assert t.tp * t.pp * t.dp * t.cp == t.accelerators
    if plan.colocated:  # rollout and training take turns on the same accelerators
        assert r.accelerators == t.accelerators <= resolved.spec.total_accelerators
    else:
        assert r.accelerators + t.accelerators <= resolved.spec.total_accelerators
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()
