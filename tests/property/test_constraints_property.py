"""Over random workloads, seeds and k: which modes can violate which constraint."""

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.policies import EARLY_STEP_MODES, PolicyConfig
from planner.schedule import check_trace
from planner.sim import LinearTiming, simulate
from planner.workload import LengthDistribution, Workload

runs = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 10_000),
        "k": st.integers(1, 3),
        "median": st.integers(5, 60),
        "tail": st.floats(1.0, 20.0),
        "groups": st.integers(1, 4),
        "spp": st.integers(1, 4),
        "prompts": st.integers(1, 6),
        "slot_mult": st.integers(1, 3),
        "steps": st.integers(1, 5),
        "train_s": st.floats(0.05, 2.0),
        "load_s": st.floats(0.0, 0.5),
        "versions": st.integers(1, 4),
        "pack": st.one_of(st.none(), st.integers(1, 12)),
        "round_trip": st.sampled_from([0.0, 0.0, 0.004, 0.05]),  # the controller's, as on cpu (0: none)
        "queue": st.booleans(),  # streaming: two groups queued per engine, as on cpu
        "early": st.booleans(),  # separate accelerators: a step held at the bound starts early (joining groups)
        # rollout / training / engine contention of disaggregated cpu plans (training's end moves as engines start
        # and stop decoding)
        "contention": st.sampled_from([(1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (1.45, 1.33, 1.43), (1.0, 3.0, 1.0)]),
    }
)


def _run(mode, p, *, mixing, colocated=False):
    k = 0 if mode == "sync" else p["k"]
    cfg = PolicyConfig(colocated=colocated,
        mode=mode, max_version_lag=k, num_rollout_groups=p["groups"], slots_per_group=p["spp"] * p["slot_mult"],
        prompts_per_step=p["prompts"], samples_per_prompt=p["spp"], total_steps=p["steps"],
        allow_version_mixing=mixing, update="interrupt" if mixing and mode == "bounded-async" else "drain",
        max_versions_per_engine=min(p["versions"], k + 1) if mode == "streaming" else 1,
        consolidation_batch=p["pack"] if mode == "streaming" else None,
        admission_queue=2 * p["spp"] if mode == "streaming" and p.get("queue") else 0,
        early_steps=bool(p.get("early")) and not colocated and mode in EARLY_STEP_MODES,
    )
    dist = LengthDistribution.lognormal(median=p["median"], p99=p["median"] * p["tail"], max_tokens=400)
    timing = LinearTiming(decode_base_s=0.01, train_base_s=p["train_s"], weight_load_trainer_s=p["load_s"],
                          weight_load_peer_s=p["load_s"] / 2, weight_publish_s=0.05, prefill_per_token_s=1e-3,
                          swap_fixed_s=p["load_s"] / 4, swap_s_per_version=0.01, swap_s_per_token=1e-4,
                          report_round_trip_s=p.get("round_trip", 0.0))
    if not colocated:  # colocated plans take turns: no contention (``Calibration.contention``)
        rollout_c, train_c, engine_c = p.get("contention", (1.0, 1.0, 1.0))
        timing = dataclasses.replace(timing, rollout_contention=rollout_c, train_contention=train_c,
                                     engine_contention=engine_c)
    r = simulate(cfg, Workload(response_length=dist, prompt_tokens=4), timing, seed=p["seed"])
    return k, r


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(runs)
def test_sync_one_step_off_streaming_never_violate(p):
    for mode in ("sync", "one-step-off", "streaming", "bounded-async"):
        k, r = _run(mode, p, mixing=False)
        rep = check_trace(list(r.events), k=k, allow_version_mixing=False)
        assert rep.ok, (mode, rep.violations[:3])
        assert rep.num_consumed == p["steps"] * p["prompts"] * p["spp"]


@FAST
@given(runs)
def test_colocated_streaming_never_violates_and_never_overlaps_training(p):
    """Rollout suspended for every training step, in-flight trajectories and all: the three constraints still hold,
    and no trajectory finishes while the trainer has the accelerators."""
    k, r = _run("streaming", p, mixing=False, colocated=True)
    rep = check_trace(list(r.events), k=k, allow_version_mixing=False)
    assert rep.ok, rep.violations[:3]
    assert rep.num_consumed == p["steps"] * p["prompts"] * p["spp"]
    # [suspended at, resumed at]: rollout resumes at the publish before the next rollout_resumed (which is reported
    # once the slowest engine is back); a step that finds enough finished groups trains again before resuming
    stopped: list[list[float]] = []
    published = 0.0
    for e in r.events:
        if e["type"] == "rollout_suspended":
            stopped.append([e["t"], float("inf")])
        elif e["type"] == "weights_published":
            published = e["t"]
        elif e["type"] == "rollout_resumed":
            stopped[-1][1] = published
    for e in r.events:
        if e["type"] == "train_step":  # the trainer has the accelerators: every engine has stopped
            assert any(a <= e["start_t"] and e["t"] <= b for a, b in stopped), (e["start_t"], stopped)
        elif e["type"] == "finished":  # nothing decodes while stopped
            assert not any(a < e["t"] < b for a, b in stopped), (e["t"], stopped)
    steps = sum(e["type"] == "train_step" for e in r.events)
    assert 1 <= sum(e["type"] == "rollout_suspended" for e in r.events) <= steps


@FAST
@given(runs)
def test_mixing_modes_are_flagged_unless_allowed(p):
    for mode in ("partial-rollout", "bounded-async"):
        k, r = _run(mode, p, mixing=True)
        strict = check_trace(list(r.events), k=k, allow_version_mixing=False)
        lenient = check_trace(list(r.events), k=k, allow_version_mixing=True)
        # integrity and staleness hold whatever the mixing policy
        assert not strict.of("integrity") and not strict.of("staleness")
        assert lenient.ok
        # every mixed trajectory is a consistency violation when mixing is not allowed
        assert len(strict.of("consistency")) == len(lenient.mixed)
        assert {v.traj for v in strict.of("consistency")} == set(lenient.mixed)
        assert len(lenient.mixed) == sum(
            1 for e in r.events if e["type"] == "finished" and len({v for v, n in e["spans"] if n > 0}) > 1
        )


def test_mixing_really_happens_with_long_tails():
    p = dict(seed=1, k=2, median=40, tail=10.0, groups=2, spp=2, prompts=3, slot_mult=2, steps=5, train_s=0.2,
             load_s=0.1)
    for mode in ("partial-rollout", "bounded-async"):
        _, r = _run(mode, p, mixing=True)
        strict = check_trace(list(r.events), k=p["k"], allow_version_mixing=False)
        assert strict.of("consistency"), mode
