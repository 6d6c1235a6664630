"""Hand-built Plans for the example specs, used by the lowering tests until the planner search lands.

Each plan is a realistic placement for its spec (sizes that multiply out and divide the model's heads, layers and
experts), chosen by hand, not by the planner. When ``planner.search`` exists, ``example_plan`` should return the
planner's plan instead and the golden files be regenerated (``pytest --update-golden``); the tests below then
check the real plans' consistency too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dora import __version__
from dora.spec import ResolvedSpec, load_spec
from planner.plan import FORMAT_VERSION, Plan, Predictions, RolloutPlan, TrainPlan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SPECS = sorted(p.stem for p in (REPO / "specs").glob("*.yaml"))

# spec stem -> (colocated, mode, rollout (accelerators, tp, ep, per replica, max_num_seqs, versions),
#               train (accelerators, tp, pp, ep, dp, cp, microbatches, micro_batch_tokens, recompute))
_PLACEMENTS = {
    "local-tiny": (False, "streaming", (1, 1, 1, 1, 32, 3), (1, 1, 1, 1, 1, 1, 4, 256, False)),
    "dense-8b-h800x64": (False, "streaming", (48, 2, 1, 2, 256, 1), (16, 2, 1, 1, 8, 1, 16, 32768, True)),
    "dense-32b-h800x128": (False, "streaming", (96, 4, 1, 4, 256, 1), (32, 8, 1, 1, 4, 1, 32, 32768, True)),
    "moe-235b-h800x512": (False, "streaming", (384, 8, 16, 16, 512, 1), (128, 4, 2, 8, 16, 1, 32, 32768, True)),
    "moe-560b-x4096": (False, "streaming", (3072, 8, 32, 32, 512, 1), (1024, 8, 4, 32, 32, 1, 64, 65536, True)),
    "moe-scale-x10240": (False, "streaming", (8192, 8, 32, 32, 512, 1), (2048, 8, 4, 16, 64, 1, 64, 65536, True)),
}


def load_example(stem: str) -> ResolvedSpec:
    return load_spec(str(REPO / "specs" / f"{stem}.yaml"))


def example_plan(resolved: ResolvedSpec, stem: str) -> Plan:
    """The hand-built plan for example spec ``stem``."""
    colocated, mode, (r_acc, r_tp, r_ep, per, seqs, versions), train = _PLACEMENTS[stem]
    t_acc, tp, pp, ep, dp, cp, micro, micro_tokens, recompute = train
    spec = resolved.spec
    max_len = spec.workload.prompt_length.max_tokens + spec.workload.response_length.max_tokens
    return make_plan(resolved, colocated=colocated, mode=mode,
                     rollout=RolloutPlan(accelerators=r_acc, tp=r_tp, ep=r_ep, replicas=r_acc // per,
                                         accelerators_per_replica=per, max_num_seqs=seqs, max_model_len=max_len,
                                         versions_per_engine=versions,
                                         gpu_memory_utilization=spec.runtime.gpu_memory_utilization,
                                         kv_capacity_tokens=seqs * max_len // 4),
                     train=TrainPlan(accelerators=t_acc, tp=tp, pp=pp, ep=ep, dp=dp, cp=cp, num_microbatches=micro,
                                     micro_batch_tokens=micro_tokens, recompute=recompute))


def make_plan(resolved: ResolvedSpec, *, colocated: bool, mode: str, rollout: RolloutPlan,
              train: TrainPlan) -> Plan:
    """A Plan around the given placement; predictions are placeholders lowering never reads."""
    spec = resolved.spec
    predictions = Predictions(
        step_time_s=60.0, generated_tokens_per_s=1.0e5, trained_tokens_per_s=1.0e5, samples_per_s=50.0,
        bubble_fraction=0.1, rollout_occupancy=0.8, rollout_share=0.6, trainer_utilization=0.7,
        weight_sync_s=2.0, mean_staleness=1.0, max_live_versions=spec.staleness.max_version_lag + 1,
        total_time_s=60.0 * spec.workload.steps, accelerator_hours=1.0, cost_usd=None, speedup_vs_sync=2.0)
    return Plan(format_version=FORMAT_VERSION, dora_version=__version__, spec_name=spec.name,
                spec_file=resolved.file, spec_hash=resolved.spec_hash, catalog_fingerprint="0" * 16,
                calibration_fingerprint="0" * 16, calibration_source="catalog", seed=spec.runtime.seed,
                objective=spec.objective, mode=mode, max_version_lag=spec.staleness.max_version_lag,
                allow_version_mixing=spec.staleness.allow_version_mixing, colocated=colocated,
                rollout=rollout, train=train, memory=(), predictions=predictions, considered=(), warnings=())


@pytest.mark.parametrize("stem", EXAMPLE_SPECS)
def test_every_example_spec_has_a_plan_that_fits_its_cluster(stem: str) -> None:
    resolved = load_example(stem)
    plan = example_plan(resolved, stem)
    r, t = plan.rollout, plan.train
    assert r.replicas * r.accelerators_per_replica == r.accelerators
    assert t.tp * t.pp * t.dp * t.cp == t.accelerators
    assert r.accelerators + t.accelerators <= resolved.spec.total_accelerators
    assert Plan.from_dict(plan.to_dict()) == plan
