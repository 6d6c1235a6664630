"""Streaming with multi-version engines (``max_versions_per_engine > 1``): policy by hand, simulator, checker."""

import pytest

from planner.policies import (
    Admit,
    DropVersion,
    LoadWeights,
    PolicyConfig,
    PublishWeights,
    StartTrainStep,
    TrainStepFinished,
    TrajectoryFinished,
    WeightsLoaded,
    WeightsPublished,
    make_policy,
)
from planner.schedule import check_trace
from planner.sim import LinearTiming, simulate
from planner.workload import LengthDistribution, Workload


def _cfg(versions, **kw):
    base = dict(mode="streaming", max_version_lag=1, num_rollout_groups=1, slots_per_group=4, prompts_per_step=1,
                samples_per_prompt=2, total_steps=3, max_versions_per_engine=versions)
    base.update(kw)
    return PolicyConfig(**base)


def _fin(p, gid, sample):
    return list(p.handle(TrajectoryFinished(group_id=gid, sample=sample, rollout_group=0, num_tokens=1)))


@pytest.mark.parametrize("versions", [1, 2])
def test_engine_keeps_its_slots_busy_across_a_version_change(versions):
    # One engine, 4 slots, groups of 2, P = 1, k = 1: the bound admits g0, g1 on v0 (engine full).
    p = make_policy(_cfg(versions))
    assert list(p.start()) == [Admit(group_id=0, rollout_group=0, version=0, num_samples=2),
                               Admit(group_id=1, rollout_group=0, version=0, num_samples=2)]
    assert _fin(p, 0, 0) == []
    assert _fin(p, 0, 1) == [StartTrainStep(step=1, group_ids=(0,))]  # budget spent: no admission
    assert list(p.handle(TrainStepFinished(step=1))) == [PublishWeights(version=1)]
    out = list(p.handle(WeightsPublished(version=1)))  # g1 (v0) still runs on the only engine
    if versions == 1:
        assert out == []  # one version per engine: wait for g1's tail with 2 of 4 slots idle
        assert p.engine_active == [2]
        return
    # v1 is loaded beside v0; g1 keeps running on v0
    assert out == [LoadWeights(rollout_group=0, version=1, source="trainer", keep_loaded=True)]
    assert list(p.handle(WeightsLoaded(rollout_group=0, version=1))) == [
        Admit(group_id=2, rollout_group=0, version=1, num_samples=2)]
    assert p.engine_active == [4] and p.hosted == [{0: 2, 1: 2}]  # all 4 slots busy, two versions hosted
    assert _fin(p, 1, 0) == []
    # g1 done: v0 has no request left on the engine -> dropped; step 2 trains on g1 (version 0)
    assert _fin(p, 1, 1) == [DropVersion(rollout_group=0, version=0), StartTrainStep(step=2, group_ids=(1,))]
    assert p.hosted == [{1: 2}] and p.group_version == [0, 0, 1]


def test_full_engine_waits_for_a_version_to_drain_before_adding_the_next():
    # V = 2, k = 2: with v0 and v1 busy on the engine, v2 is added only once one of them drains.
    p = make_policy(_cfg(2, max_version_lag=2, slots_per_group=6, total_steps=4))
    assert [a.group_id for a in p.start()] == [0, 1, 2]  # bound (0 + 2 + 1) * 1 = 3 groups on v0
    _fin(p, 0, 0)
    assert _fin(p, 0, 1) == [StartTrainStep(step=1, group_ids=(0,))]
    p.handle(TrainStepFinished(step=1))
    assert list(p.handle(WeightsPublished(version=1))) == [
        LoadWeights(rollout_group=0, version=1, source="trainer", keep_loaded=True)]
    assert [a.group_id for a in p.handle(WeightsLoaded(rollout_group=0, version=1))] == [3]
    _fin(p, 1, 0)
    assert _fin(p, 1, 1) == [StartTrainStep(step=2, group_ids=(1,))]
    p.handle(TrainStepFinished(step=2))
    assert list(p.handle(WeightsPublished(version=2))) == []  # v0 (g2) and v1 (g3) busy: engine at V = 2
    _fin(p, 2, 0)
    out = _fin(p, 2, 1)  # v0 drained: drop it, add v2 beside v1
    assert out[:2] == [DropVersion(rollout_group=0, version=0),
                       LoadWeights(rollout_group=0, version=2, source="trainer", keep_loaded=True)]


def test_versions_per_engine_is_streaming_only_and_at_most_k_plus_1():
    with pytest.raises(ValueError, match="not supported in mode 'bounded-async'"):
        _cfg(2, mode="bounded-async")
    with pytest.raises(ValueError, match=r"k\+1 = 2"):
        _cfg(3)


LONG_TAIL = Workload(response_length=LengthDistribution.lognormal(median=20, p99=400, max_tokens=600),
                     prompt_tokens=4)
TIMING = LinearTiming(decode_base_s=0.01, train_base_s=0.5, weight_publish_s=0.05, weight_load_trainer_s=0.1,
                      weight_load_peer_s=0.05)


def test_simulated_multi_version_engine_is_busier_and_clean():
    runs = {}
    for versions in (1, 2, 3):
        c = _cfg(versions, max_version_lag=2, slots_per_group=16, prompts_per_step=4, samples_per_prompt=4,
                 total_steps=12)
        r = simulate(c, LONG_TAIL, TIMING, seed=3)
        rep = check_trace(list(r.events), k=2, allow_version_mixing=False)
        assert rep.ok, rep.violations[:3]
        assert rep.num_consumed == 12 * 4 * 4 and r.mixed_trajectories == 0 and r.migrated_trajectories == 0
        runs[versions] = r
    assert any(e["type"] == "version_dropped" for e in runs[2].events)
    assert runs[2].rollout_slot_occupancy > runs[1].rollout_slot_occupancy
    assert runs[3].rollout_slot_occupancy > runs[1].rollout_slot_occupancy


def test_simulator_charges_one_forward_per_hosted_version():
    # Fixed 100-token responses, 10 ms per forward whatever the batch (1 s per response alone), train 0.5 s,
    # instant publish/load. One engine, 4 slots, groups of 2, P = 1, k = 1.
    # Both: g0, g1 on v0 finish at 1.0; step 1 (g0) 1.0-1.5; v1 -> g2 admitted at 1.5; step 2 (g1) 1.5-2.0.
    # V = 1: g2 runs alone until 2.5, then v2 loads, step 3 (g2) 2.5-3.0.
    # V = 2: at 2.0 v2 is added beside v1 and g3 starts on it; g2's last 50 tokens now cost two forwards per
    # step (20 ms): g2 ends at 3.0, step 3 runs 3.0-3.5 -- the extra version is charged, not free.
    fixed = Workload(response_length=LengthDistribution.lognormal(median=100, p99=100, max_tokens=1000),
                     prompt_tokens=10)
    timing = LinearTiming(decode_base_s=0.01, train_base_s=0.5)
    one = simulate(_cfg(1, total_steps=3), fixed, timing, seed=0)
    two = simulate(_cfg(2, total_steps=3), fixed, timing, seed=0)
    assert check_trace(list(two.events), k=1, allow_version_mixing=False).ok
    assert [s.end_s for s in one.steps] == pytest.approx([1.5, 2.0, 3.0])
    assert [s.end_s for s in two.steps] == pytest.approx([1.5, 2.0, 3.5])


# ----------------------------------------------------------------------------- admission queue
def test_admission_queue_admits_a_group_ahead_of_free_slots():
    # 4 slots, groups of 2, k = 2, P = 1: the bound allows 3 groups; without a queue only 2 fit.
    assert len(list(make_policy(_cfg(1, max_version_lag=2)).start())) == 2
    p = make_policy(_cfg(1, max_version_lag=2, admission_queue=2))
    assert [a.group_id for a in p.start()] == [0, 1, 2]
    assert p.engine_active == [6]


def test_simulated_queue_runs_at_most_the_slots_and_starts_a_queued_request_when_one_frees():
    # Fixed 100-token responses, 10 ms per step whatever the batch: g0, g1 fill the 4 slots over 0-1 s; g2 waits
    # in the queue and runs 1-2 s. Occupancy can never exceed the running slots.
    fixed = Workload(response_length=LengthDistribution.lognormal(median=100, p99=100, max_tokens=1000),
                     prompt_tokens=10)
    timing = LinearTiming(decode_base_s=0.01, train_base_s=0.5)
    r = simulate(_cfg(1, max_version_lag=2, total_steps=3, admission_queue=2), fixed, timing, seed=0)
    assert check_trace(list(r.events), k=2, allow_version_mixing=False).ok
    finished = {e["traj"]: e["t"] for e in r.events if e["type"] == "finished"}
    assert finished["g0/0"] == pytest.approx(1.0) and finished["g1/1"] == pytest.approx(1.0)
    assert finished["g2/0"] == pytest.approx(2.0) and finished["g2/1"] == pytest.approx(2.0)
    assert r.rollout_slot_occupancy <= 1.0


def test_admission_queue_is_streaming_on_cpu_only():
    from planner.policies import admission_queue_for

    with pytest.raises(ValueError, match="admission_queue is for mode 'streaming'"):
        _cfg(1, mode="bounded-async", admission_queue=2)
    assert admission_queue_for("streaming", "cpu", 8) == 16  # two groups ahead
    assert admission_queue_for("streaming", "h800", 8) == 0
    assert admission_queue_for("sync", "cpu", 8) == 0
