import dataclasses

import pytest

from planner.policies import PolicyConfig
from planner.schedule import check_trace
from planner.sim import LinearTiming, simulate
from planner.workload import LengthDistribution, Workload

# every response is exactly 100 tokens; one decode step takes 10 ms whatever the batch
FIXED = Workload(response_length=LengthDistribution.lognormal(median=100, p99=100, max_tokens=1000), prompt_tokens=10)
HAND = LinearTiming(decode_base_s=0.01, train_base_s=5.0, weight_publish_s=1.0, weight_load_trainer_s=2.0)


def cfg(mode, **kw):
    base = dict(mode=mode, max_version_lag=1, num_rollout_groups=1, slots_per_group=4, prompts_per_step=1,
                samples_per_prompt=2, total_steps=3)
    base.update(kw)
    return PolicyConfig(**base)


def test_sync_by_hand():
    # gen 100 x 0.01 = 1 s, train 5 s, publish 1 s, load 2 s: steps end at 6, 15, 24
    r = simulate(cfg("sync", max_version_lag=0), FIXED, HAND, seed=0)
    assert [s.end_s for s in r.steps] == pytest.approx([6.0, 15.0, 24.0])
    assert r.step_time_s == pytest.approx(9.0)
    assert r.samples_per_s == pytest.approx(2 / 9.0)
    assert r.tokens_per_s == pytest.approx(2 * 110 / 9.0)
    assert r.rollout_busy_fraction == pytest.approx(3 / 24)
    assert r.rollout_slot_occupancy == pytest.approx(2 * 3 / (4 * 24))
    assert r.weight_loads == 2 and r.weight_load_s_total == pytest.approx(4.0)
    assert r.staleness_histogram == ((0, 6),)
    # three steps and the two publishes before the end (the third publish starts as the run ends)
    assert r.train_busy_fraction == pytest.approx((3 * 5 + 2 * 1) / 24)
    assert r.weight_publish_s_total == pytest.approx(2.0)


def test_one_step_off_by_hand():
    # batch1 0-1, step1 1-6 (publish 7); batch2 on v0 1-2; load v1 7-9, batch3 9-10;
    # step2 7-12 (publish 13); step3 13-18
    r = simulate(cfg("one-step-off"), FIXED, HAND, seed=0)
    assert [s.end_s for s in r.steps] == pytest.approx([6.0, 12.0, 18.0])
    assert [s.start_s for s in r.steps] == pytest.approx([1.0, 7.0, 13.0])
    assert r.staleness_histogram == ((0, 2), (1, 4))


def test_colocated_streaming_by_hand():
    """Rollout stops for each step with its requests kept, and resumes only when no step is ready.

    t=0 groups g0, g1 start (the budget at k=1: two groups); all four samples reach 100 tokens at t=1. g0 finishes
    first, step 1 is ready: suspend, moving g1's KV (2 x 110 tokens) and the weights, 0.1 + 0.2 + 0.22 s -> 1.52;
    step 1 trains 1.52-6.52, publishes to 7.52. g1 finished before the stop: step 2 trains at once, rollout stays
    stopped, 7.52-12.52, publish to 13.52. Nothing left: resume the empty engine (0.1 + 0.2 s -> 13.82), load v2 from
    the trainer (2 s -> 15.82), g2 and g3 run to 16.82, suspend again (0.52 s -> 17.34), step 3 17.34-22.34."""
    timing = dataclasses.replace(HAND, swap_fixed_s=0.1, swap_s_per_version=0.2, swap_s_per_token=0.001)
    r = simulate(cfg("streaming", colocated=True), FIXED, timing, seed=0)
    assert [s.start_s for s in r.steps] == pytest.approx([1.52, 7.52, 17.34])
    assert [s.end_s for s in r.steps] == pytest.approx([6.52, 12.52, 22.34])
    assert r.swap_s_total == pytest.approx(0.52 + 0.3 + 0.52)
    assert r.suspend_wall_s_total == pytest.approx(0.52 + 0.3 + 0.52)  # one engine: its moves are the critical path
    assert r.staleness_histogram == ((0, 4), (1, 2))
    kinds = [(e["type"], round(e["t"], 6)) for e in r.events if e["type"].startswith("rollout_")]
    assert kinds == [("rollout_suspended", 1.52), ("rollout_resumed", 13.82), ("rollout_suspended", 17.34)]
    assert check_trace(list(r.events), k=1, allow_version_mixing=False).ok
    # the trainer's accelerators are the engines': the same run on separate ones overlaps them instead
    apart = simulate(cfg("streaming"), FIXED, HAND, seed=0)
    assert apart.swap_s_total == 0.0 and not any(e["type"].startswith("rollout_") for e in apart.events)


def test_prefill_and_batch_dependent_step_time():
    timing = LinearTiming(decode_base_s=0.01, decode_per_seq_s=0.005, prefill_per_token_s=0.1, train_base_s=1.0)
    r = simulate(cfg("sync", max_version_lag=0, total_steps=1), FIXED, timing, seed=0)
    # one prefill of the shared 10-token prompt (1 s), then 100 steps of 0.01 + 2 * 0.005
    assert r.steps[0].start_s == pytest.approx(1.0 + 100 * 0.02)


def test_context_dependent_step_time_uses_interval_mean():
    timing = LinearTiming(decode_base_s=0.01, decode_per_context_token_s=1e-4, train_base_s=1.0)
    cfg1 = cfg("sync", max_version_lag=0, total_steps=1, samples_per_prompt=1, slots_per_group=1)
    r = simulate(cfg1, FIXED, timing, seed=0)
    # context grows 10 -> 110 linearly: 100 * (0.01 + 1e-4 * 60)
    assert r.steps[0].start_s == pytest.approx(100 * (0.01 + 1e-4 * 60))


def test_deterministic_given_seed_and_seed_matters():
    w = Workload(response_length=LengthDistribution.lognormal(median=50, p99=400, max_tokens=500), prompt_tokens=5)
    c = cfg("streaming", max_version_lag=2, num_rollout_groups=3, slots_per_group=8, prompts_per_step=4,
            total_steps=4)
    t = LinearTiming(decode_base_s=0.01, train_base_s=0.5, weight_load_trainer_s=0.2, weight_load_peer_s=0.1)
    a, b, other = simulate(c, w, t, seed=5), simulate(c, w, t, seed=5), simulate(c, w, t, seed=6)
    assert a.events == b.events and a == b
    assert a.events != other.events


def test_simulations_of_one_workload_and_seed_share_their_draws_and_nothing_else():
    """Lengths are drawn once per (distribution, seed) and shared: a run after a longer one reads the lengths already
    drawn, and gives exactly what it gives on fresh draws; another seed or distribution has its own."""
    from planner.sim import simulator

    dist = LengthDistribution.lognormal(median=60, p99=500, max_tokens=600)
    w = Workload(response_length=dist, prompt_tokens=5)
    t = LinearTiming(decode_base_s=0.01, train_base_s=0.5, weight_load_trainer_s=0.2, weight_load_peer_s=0.1)
    short = cfg("streaming", max_version_lag=2, num_rollout_groups=3, slots_per_group=8, prompts_per_step=4,
                total_steps=3)
    simulator._STREAMS.clear()
    fresh = simulate(short, w, t, seed=9)
    simulate(dataclasses.replace(short, total_steps=12, mode="bounded-async"), w, t, seed=9)
    stream = simulator.length_stream(dist, 9, 0)
    drawn = len(stream.drawn)
    again = simulate(short, w, t, seed=9)
    assert len(stream.drawn) == drawn  # nothing drawn: the longer run drew ahead of it
    assert again == fresh and again.events == fresh.events
    assert simulator.length_stream(dist, 10, 0) is not stream
    assert simulator.length_stream(dist, 9, 2) is not stream  # lengths per prompt: one draw per group of 2
    for seed in range(20, 20 + simulator._STREAMS_KEPT):
        simulator.length_stream(dist, seed, 0)
    assert len(simulator._STREAMS) == simulator._STREAMS_KEPT
    assert simulator.length_stream(dist, 9, 0) is not stream  # the least recently used went first


def test_cheap_mode_has_same_metrics_without_events():
    w = Workload(response_length=LengthDistribution.lognormal(median=50, p99=400, max_tokens=500), prompt_tokens=5)
    c = cfg("bounded-async", num_rollout_groups=2, slots_per_group=8, prompts_per_step=3, total_steps=4)
    t = LinearTiming(decode_base_s=0.01, train_base_s=0.5)
    full, cheap = simulate(c, w, t, seed=1), simulate(c, w, t, seed=1, record_events=False)
    assert cheap.events is None
    assert cheap.steps == full.steps and cheap.bubble_fraction == full.bubble_fraction


@pytest.mark.parametrize("mode", ["sync", "one-step-off", "bounded-async", "partial-rollout", "streaming"])
def test_every_mode_yields_a_clean_trace(mode):
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=600, max_tokens=800), prompt_tokens=5)
    k = 0 if mode == "sync" else 2
    c = cfg(mode, max_version_lag=k, num_rollout_groups=4, slots_per_group=8, prompts_per_step=5,
            samples_per_prompt=4, total_steps=5, allow_version_mixing=mode == "partial-rollout")
    t = LinearTiming(decode_base_s=0.01, train_base_s=0.4, weight_publish_s=0.1, weight_load_trainer_s=0.3,
                     weight_load_peer_s=0.1, prefill_per_token_s=0.001, kv_migration_s_per_token=1e-5)
    r = simulate(c, w, t, seed=3)
    rep = check_trace(list(r.events), k=k, allow_version_mixing=True)
    assert rep.ok, rep.violations[:3]
    assert len(r.steps) == 5 and rep.num_consumed == 5 * 5 * 4
    assert rep.num_trajectories == rep.num_consumed + len(rep.unfinished_at_end)
    assert r.unfinished_at_end == len(rep.unfinished_at_end)
    assert max(s for s, _ in r.staleness_histogram) <= k
    assert 0.0 <= r.bubble_fraction <= 1.0 and 0.0 < r.rollout_slot_occupancy <= 1.0
    if mode in ("sync", "one-step-off", "streaming"):
        assert r.mixed_trajectories == 0


def test_streaming_migrates_and_keeps_versions_per_group():
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=1500, max_tokens=2000), prompt_tokens=5)
    c = cfg("streaming", max_version_lag=3, num_rollout_groups=6, slots_per_group=16, prompts_per_step=6,
            samples_per_prompt=4, total_steps=8)
    t = LinearTiming(decode_base_s=0.01, train_base_s=1.0, weight_load_trainer_s=0.5, weight_load_peer_s=0.2)
    r = simulate(c, w, t, seed=11)
    assert r.migrated_trajectories > 0 and r.max_engine_versions >= 2
    admitted = {}
    for e in r.events:
        if e["type"] == "admitted":
            admitted.setdefault(e["traj"].split("/")[0], set()).add(e["version"])
    assert all(len(vs) == 1 for vs in admitted.values())  # one version per prompt group
    assert check_trace(list(r.events), k=3, allow_version_mixing=False).ok


def test_cost_model_timing_cache_matches_the_cost_model() -> None:
    from planner.architecture import get_preset
    from planner.hardware import get_accelerator
    from planner.sim.costmodel import cost_model_timing

    for preset, tp, ep, dp in (("qwen2.5-32b", 4, 1, 1), ("qwen3-235b-a22b", 16, 16, 1), ("qwen3-235b-a22b", 1, 32, 32),
                                ("qwen3-235b-a22b", 4, 32, 8)):
        timing = cost_model_timing(get_preset(preset), rollout_acc=get_accelerator("h800"),
                                   train_acc=get_accelerator("h800"), rollout_tp=tp, rollout_ep=ep, rollout_dp=dp,
                                   num_rollout_groups=4, train_tp=4, train_pp=2, train_dp=2, train_ep=1 if ep == 1 else 4)
        for batch in (1, 7, 64, 7, 256):
            for ctx in (0.0, 1e3 * batch, 3e4 * batch):
                assert timing.decode_step_s(batch, ctx) == pytest.approx(timing.rollout.decode_step_s(batch, ctx),
                                                                         rel=1e-12)
                if dp > 1:  # by rank: the same at an even spread, and the cache matches the model at any
                    busiest = -(-batch // dp)
                    even = timing.decode_step_ranks_s(batch, busiest, ctx * busiest / batch)
                    assert even == pytest.approx(timing.decode_step_s(batch, ctx), rel=1e-12)
                    for rank_batch, rank_ctx in ((busiest, ctx), (batch, ctx / 2), (busiest + 1, ctx / dp)):
                        assert timing.decode_step_ranks_s(batch, rank_batch, rank_ctx) == pytest.approx(
                            timing.rollout.decode_step_ranks_s(batch, rank_batch, rank_ctx), rel=1e-12)
                    if ctx and batch > 1:  # one rank holding all the context is slower than an even spread
                        assert timing.decode_step_ranks_s(batch, busiest, ctx) > even
        assert timing.decode_step_s(0, 0.0) == 0.0


def test_contention_slows_only_what_overlaps():
    from dataclasses import replace

    both = replace(HAND, rollout_contention=1.5, train_contention=2.0)
    # sync never decodes while it trains: nothing changes
    plain = simulate(cfg("sync", max_version_lag=0), FIXED, HAND, seed=0)
    slowed = simulate(cfg("sync", max_version_lag=0), FIXED, both, seed=0)
    assert [s.end_s for s in slowed.steps] == pytest.approx([s.end_s for s in plain.steps])
    # one-step-off (see test_one_step_off_by_hand): batch 1 decodes alone (1 s), batches 2 and 3 during steps 1
    # and 2 (1.5 s each); every training step starts with the engine idle or loading, so they keep 5 s
    r = simulate(cfg("one-step-off"), FIXED, replace(HAND, rollout_contention=1.5), seed=0)
    assert [s.end_s for s in r.steps] == pytest.approx([6.0, 12.0, 18.0])
    assert r.rollout_busy_fraction * r.total_time_s == pytest.approx(1.0 + 1.5 + 1.5)
    # a training step runs at half speed only while the engine decodes. One-step-off: step 1 trains 1-6.5 (batch 2
    # decodes 1-2: 0.5 s of work in that second, 4.5 s after), publishes to 7.5; the engine loads v1 7.5-9.5 while
    # step 2 starts at 7.5 with the engine idle, and batch 3 decodes 9.5-10.5 beside it: 2 s + 1 s + 2.5 s -> 13;
    # step 3 trains 14-19 with nothing left to decode
    r = simulate(cfg("one-step-off"), FIXED, replace(HAND, train_contention=2.0), seed=0)
    assert [x for s in r.steps for x in (s.start_s, s.end_s)] == pytest.approx([1.0, 6.5, 7.5, 13.0, 14.0, 19.0])
    assert r.train_busy_fraction * r.total_time_s == pytest.approx(5.5 + 5.5 + 5.0 + 2 * 1.0)  # and two publishes
    # streaming: g0-g2 all finish at t=1, so step 1 (1-6) has nothing decoding beside it; each later step starts as
    # its version's group is admitted, which decodes for its first second (5.5 s)
    t = replace(HAND, train_contention=2.0, weight_load_trainer_s=0.0)
    r = simulate(cfg("streaming", max_version_lag=2, slots_per_group=8, total_steps=4), FIXED, t, seed=0,
                 record_events=True)
    assert [s.end_s - s.start_s for s in r.steps] == pytest.approx([5.0, 5.5, 5.5, 5.5])
    ends = [e["t"] for e in r.events if e["type"] == "train_step"]  # the trace's ends moved with the contention
    assert ends == pytest.approx([s.end_s for s in r.steps])


def test_engine_contention_slows_replicas_only_while_two_decode():
    from dataclasses import replace

    # sync, two replicas, one prompt group each, each group's samples of one length: both replicas decode
    # together until the shorter group ends (1.5x slower meanwhile), then the other decodes alone
    w = Workload(response_length=LengthDistribution.lognormal(median=60, p99=400, max_tokens=500), prompt_tokens=5,
                 length_per_prompt=True)
    c = cfg("sync", max_version_lag=0, num_rollout_groups=2, slots_per_group=2, prompts_per_step=2, total_steps=1)
    r = simulate(c, w, replace(HAND, engine_contention=1.5), seed=4, record_events=True)
    ends = {e["rollout_group"]: e["num_tokens"] for e in r.events if e["type"] == "finished"}
    short, long = sorted(ends.values())
    assert len(ends) == 2 and short < long
    assert r.steps[0].start_s == pytest.approx(0.01 * (1.5 * short + (long - short)))
    # one replica decodes alone whatever the factor
    one = cfg("sync", max_version_lag=0, prompts_per_step=2, total_steps=1)
    assert simulate(one, w, replace(HAND, engine_contention=1.5), seed=4).steps[0].start_s == pytest.approx(
        simulate(one, w, HAND, seed=4).steps[0].start_s)


def test_multi_version_engine_decodes_while_it_loads_a_version():
    from dataclasses import replace

    # one engine hosting up to 3 versions, 10 ms a step with one version busy: a load of v1 takes 0.3 s from the
    # end of step 1, and the engine's v0 requests keep decoding meanwhile, so every request that finishes before
    # v1 is served has taken exactly 10 ms a token since its admission, some of them inside the load
    w = Workload(response_length=LengthDistribution.lognormal(median=60, p99=400, max_tokens=500), prompt_tokens=5)
    t = replace(HAND, weight_load_trainer_s=0.3, train_base_s=0.2, weight_publish_s=0.0)
    c = cfg("streaming", max_version_lag=2, slots_per_group=16, prompts_per_step=2, total_steps=4,
            max_versions_per_engine=3)
    r = simulate(c, w, t, seed=1, record_events=True)
    started = next(e["t"] for e in r.events if e["type"] == "weights_load_started")
    served = next(e["t"] for e in r.events if e["type"] == "weights_loaded")
    assert served == pytest.approx(started + 0.3)
    admitted = {e["traj"]: e["t"] for e in r.events if e["type"] == "admitted"}
    early = [e for e in r.events if e["type"] == "finished" and e["t"] < served]
    assert any(e["t"] > started for e in early)
    for e in early:
        assert e["t"] == pytest.approx(admitted[e["traj"]] + 0.01 * e["num_tokens"])


def _busiest_destination(events) -> tuple[int, int]:
    """Replay a trace's per-engine request counts; (migrations, most requests a destination held right after one)."""
    where: dict[str, int] = {}
    count: dict[int, int] = {}
    moves = peak = 0
    for e in events:
        if e["type"] == "admitted":
            where[e["traj"]] = e["rollout_group"]
            count[e["rollout_group"]] = count.get(e["rollout_group"], 0) + 1
        elif e["type"] in ("finished", "unfinished_at_end") and e["traj"] in where:
            count[where.pop(e["traj"])] -= 1
        elif e["type"] == "migrated":
            for traj in e["trajs"]:
                count[where[traj]] -= 1
                where[traj] = e["dst"]
            count[e["dst"]] += len(e["trajs"])
            moves += 1
            peak = max(peak, count[e["dst"]])
    return moves, peak


def test_streaming_consolidation_packs_engines_only_up_to_consolidation_batch():
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=1500, max_tokens=2000), prompt_tokens=5)
    t = LinearTiming(decode_base_s=0.01, decode_per_seq_s=0.001, train_base_s=1.0, weight_load_trainer_s=0.5,
                     weight_load_peer_s=0.2)
    base = dict(max_version_lag=3, num_rollout_groups=6, slots_per_group=32, prompts_per_step=12, samples_per_prompt=4,
                total_steps=8)
    full = simulate(cfg("streaming", **base), w, t, seed=11)
    capped = simulate(cfg("streaming", consolidation_batch=12, **base), w, t, seed=11)
    moves, peak = _busiest_destination(full.events)
    assert moves > 0 and peak > 12  # unbounded packing fills destinations past the cap used below
    moves, peak = _busiest_destination(capped.events)
    assert moves > 0 and peak <= 12
    assert check_trace(list(capped.events), k=3, allow_version_mixing=False).ok


def _due_version_destinations(events: list[dict], k: int) -> list[int]:
    """Requests on the destination after each migration of the version the trainer must finish next (the due one,
    ``next_step - k - 1``, with ``next_step - 1`` the training steps started so far)."""
    version, where, count = {}, {}, {}
    starts = [e["start_t"] for e in events if e["type"] == "train_step"]
    out = []
    for e in events:
        if e["type"] == "admitted":
            version[e["traj"]], where[e["traj"]] = e["version"], e["rollout_group"]
            count[e["rollout_group"]] = count.get(e["rollout_group"], 0) + 1
        elif e["type"] == "finished":
            count[where[e["traj"]]] -= 1
        elif e["type"] == "migrated":
            for traj in e["trajs"]:
                count[where[traj]] -= 1
                where[traj] = e["dst"]
            count[e["dst"]] += len(e["trajs"])
            if e["t"] in starts:
                continue  # a step starting at the same instant: which version is due is ambiguous
            due = sum(1 for s in starts if s < e["t"]) - k
            if version[e["trajs"][0]] <= due:
                out.append(count[e["dst"]])
    return out


def test_streaming_packs_the_version_the_trainer_waits_for_to_the_consolidation_batch_too():
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=1500, max_tokens=2000), prompt_tokens=5)
    t = LinearTiming(decode_base_s=0.01, decode_per_seq_s=0.001, train_base_s=1.0, weight_load_trainer_s=0.5,
                     weight_load_peer_s=0.2)
    c = cfg("streaming", max_version_lag=1, num_rollout_groups=6, slots_per_group=32, prompts_per_step=12,
            samples_per_prompt=4, total_steps=8, consolidation_batch=12)
    r = simulate(c, w, t, seed=0, record_events=True)
    peaks = _due_version_destinations(list(r.events), k=1)
    # with k = 1 every older version is the due one; it is packed past half the consolidation batch (the rule dora
    # had until bench/due_packing.py, run from the Python sources, showed it losing at steady state), never past it
    assert len(peaks) >= 2 and 6 < max(peaks) <= 12
    assert check_trace(list(r.events), k=1, allow_version_mixing=False).ok


def test_only_sync_and_streaming_take_turns_with_the_trainer():
    cfg("streaming", colocated=True)
    for mode in ("one-step-off", "bounded-async"):
        with pytest.raises(ValueError, match="time-shares in modes 'sync' and 'streaming'"):
            cfg(mode, colocated=True)


def test_update_is_validated_and_interrupts_only_bounded_async():
    """update='interrupt' outside bounded-async was accepted, ignored by the policy, and yet turned prompt ingestion
    off in the simulator and the runtime; a misspelt update silently drained."""
    with pytest.raises(ValueError, match="update must be 'drain' or 'interrupt', got 'bogus'"):
        cfg("bounded-async", update="bogus")
    for mode in ("streaming", "sync", "partial-rollout"):
        with pytest.raises(ValueError, match="update='interrupt' is for mode 'bounded-async'"):
            cfg(mode, update="interrupt", allow_version_mixing=True)
    assert cfg("bounded-async", update="interrupt", allow_version_mixing=True).interrupts
    assert cfg("partial-rollout", allow_version_mixing=True).interrupts and not cfg("streaming").interrupts


def test_planner_and_runtime_run_bounded_async_with_mixing_alike():
    """The search simulated bounded-async with mixing allowed as interrupting, while the runtime drained: the plan
    predicted another policy than the one that ran."""
    from pathlib import Path

    from dora.apply import ApplyOverrides, runtime_config_for
    from dora.runtime.driver import controller_config
    from dora.spec import load_spec
    from planner.policies import update_for

    assert update_for("bounded-async", True) == "interrupt" and update_for("bounded-async", False) == "drain"
    assert update_for("partial-rollout", True) == "drain"  # it interrupts by mode
    spec = Path(__file__).resolve().parents[2] / "specs" / "local-tiny.yaml"
    rc = runtime_config_for(load_spec(str(spec)), ApplyOverrides(mode="bounded-async"))
    for mixing in (True, False):
        run = dataclasses.replace(rc, allow_version_mixing=mixing)
        policy = controller_config(run).policy
        assert policy.update == update_for("bounded-async", mixing) and policy.interrupts is mixing


def test_consolidation_batch_is_validated():
    with pytest.raises(ValueError, match="consolidation_batch must be >= 1"):
        cfg("streaming", consolidation_batch=0)
    with pytest.raises(ValueError, match="consolidation_batch is for mode 'streaming'"):
        cfg("bounded-async", consolidation_batch=8)


def test_length_per_prompt_gives_every_sample_of_a_group_its_length():
    dist = LengthDistribution.lognormal(median=50, p99=400, max_tokens=500)
    c = cfg("sync", max_version_lag=0, num_rollout_groups=2, slots_per_group=32, prompts_per_step=8,
            samples_per_prompt=4, total_steps=4)
    shared = simulate(c, Workload(response_length=dist, prompt_tokens=5, length_per_prompt=True), HAND, seed=3,
                      record_events=True)
    per_group: dict[str, set[int]] = {}
    for e in shared.events:
        if e["type"] == "finished":
            per_group.setdefault(e["traj"].split("/")[0], set()).add(e["num_tokens"])
    assert len(per_group) == 4 * 8 and all(len(v) == 1 for v in per_group.values())
    assert len({next(iter(v)) for v in per_group.values()}) > 8  # one independent draw per group
    independent = simulate(c, Workload(response_length=dist, prompt_tokens=5), HAND, seed=3, record_events=True)
    lengths = {e["traj"]: e["num_tokens"] for e in independent.events if e["type"] == "finished"}
    assert any(lengths[f"g{g}/0"] != lengths[f"g{g}/1"] for g in range(32))
    assert check_trace(list(shared.events), k=0, allow_version_mixing=False).ok


class _Scripted:
    """A length distribution that gives these lengths in order, then ``tail`` for ever."""

    def __init__(self, lengths: list[int], tail: int) -> None:
        self.lengths, self.tail, self.drawn = list(lengths), tail, 0

    def sample_many(self, rng, n: int) -> list[int]:
        out = [self.lengths[i] if i < len(self.lengths) else self.tail for i in range(self.drawn, self.drawn + n)]
        self.drawn += n
        return out


def _scripted(lengths: list[int], tail: int, prompt_tokens: int = 1) -> Workload:
    return dataclasses.replace(Workload(response_length=FIXED.response_length, prompt_tokens=prompt_tokens),
                               response_length=_Scripted(lengths, tail))


def test_a_queued_version_costs_a_multi_version_engine_nothing_until_it_runs():
    # 1 slot + a queue of 1; decode 1 s, +0.5 s per extra version with running sequences; lengths g0 2, g1 20, then 10.
    # g0 runs 0-2, then g1 (v0); step 1 trains 2-3; at 3 the engine loads v1 beside v0 and admits g2 (v1), which
    # queues behind g1: only v0 runs, so g1's last 19 tokens take 19 s (not 19 x 1.5) and step 2 trains 22-23
    timing = LinearTiming(decode_base_s=1.0, train_base_s=1.0, extra_version_step_s=0.5)
    c = cfg("streaming", slots_per_group=1, samples_per_prompt=1, total_steps=2, max_versions_per_engine=2,
            admission_queue=1)
    r = simulate(c, _scripted([2, 20], 10), timing, seed=0)
    assert [s.end_s for s in r.steps] == pytest.approx([3.0, 23.0])
    assert check_trace(list(r.events), k=1, allow_version_mixing=False).ok


def test_max_engine_versions_counts_versions_served_side_by_side():
    # 2 slots: from 3 to 25 the engine decodes g1 on v0 beside g2 on v1 (each step 1.5 s)
    timing = LinearTiming(decode_base_s=1.0, train_base_s=1.0, extra_version_step_s=0.5)
    c = cfg("streaming", slots_per_group=2, samples_per_prompt=1, total_steps=2, max_versions_per_engine=2)
    r = simulate(c, _scripted([2, 20], 10), timing, seed=0)
    finished = {e["traj"]: e["t"] for e in r.events if e["type"] == "finished"}
    assert finished["g2/0"] == pytest.approx(3 + 10 * 1.5) and finished["g1/0"] == pytest.approx(25.0)
    assert r.max_engine_versions == 2
    single = simulate(cfg("streaming", slots_per_group=2, samples_per_prompt=1, total_steps=2),
                      _scripted([2, 20], 10), timing, seed=0)
    assert single.max_engine_versions == 1  # a single-version engine serves v0, then v1


def test_work_running_past_the_end_counts_only_up_to_the_end():
    # colocated sync, 2 engines x 2 slots x 2 accelerators, 2 prompts x 2 samples of 10 tokens, decode 1 s, train 5 s,
    # publish 1 s, load 2 s: gen 0-10, train 10-15, publish 15-16, load 16-18, gen 18-28, train 28-33 = the end;
    # the last publish (33-34) lies past it
    timing = LinearTiming(decode_base_s=1.0, train_base_s=5.0, weight_publish_s=1.0, weight_load_trainer_s=2.0)
    ten = Workload(response_length=LengthDistribution.lognormal(median=10, p99=10, max_tokens=10), prompt_tokens=1)
    c = cfg("sync", max_version_lag=0, num_rollout_groups=2, slots_per_group=2, prompts_per_step=2, total_steps=2,
            colocated=True)
    r = simulate(c, ten, timing, seed=0, accelerators_per_group=2)
    assert r.total_time_s == pytest.approx(33.0)
    assert r.train_busy_fraction == pytest.approx(11 / 33) and r.weight_publish_s_total == pytest.approx(1.0)
    assert r.bubble_fraction == pytest.approx(1 - (2 * 2 * 20 + 4 * 11) / (4 * 33))
    # an admission's prefill (1 s) that starts at 11, as the only step trains 11-11.5
    timing = LinearTiming(decode_base_s=1.0, train_base_s=0.5, prefill_per_token_s=0.1)
    ten_prompt = Workload(response_length=ten.response_length, prompt_tokens=10)
    c = cfg("bounded-async", slots_per_group=1, samples_per_prompt=1, total_steps=1)
    r = simulate(c, ten_prompt, timing, seed=0)
    assert r.total_time_s == pytest.approx(11.5) and r.rollout_busy_fraction == pytest.approx(1.0)
    # a 10 s weight load that starts at 16, while step 2 trains 16-21
    timing = LinearTiming(decode_base_s=1.0, train_base_s=5.0, weight_publish_s=1.0, weight_load_trainer_s=10.0)
    c = cfg("bounded-async", slots_per_group=2, samples_per_prompt=1, total_steps=2)
    r = simulate(c, ten, timing, seed=0)
    assert r.total_time_s == pytest.approx(21.0)
    assert r.weight_loads == 1 and r.weight_load_s_total == pytest.approx(5.0)


def test_unfinished_requests_that_never_started_are_not_reported_finished():
    # 1 slot + a queue of 2: g0 (1 token) finishes at 1 and step 1 trains 1-6; g1 runs, g2 waits in the queue
    c = cfg("streaming", max_version_lag=2, slots_per_group=1, samples_per_prompt=1, total_steps=1, admission_queue=2)
    r = simulate(c, _scripted([1, 100, 100], 100), LinearTiming(decode_base_s=1.0, train_base_s=5.0), seed=0)
    unfinished = {e["traj"]: e["finished"] for e in r.events if e["type"] == "unfinished_at_end"}
    assert unfinished == {"g1/0": False, "g2/0": False}
    assert r.live_versions[0] == (0.0, (0,))  # the timeline starts at 0


def test_a_full_kv_cache_preempts_the_sequence_scheduled_last_and_recomputes_it():
    # sync, one engine, two 10-token sequences of a 1-token prompt, a 14-token KV cache; decode 1 s, prefill 0.1 s per
    # token. Both start at 0.2 (two prompt prefills); their context 2 x (1 + pos) reaches 14 at pos 6 (t = 6.2), so the
    # one scheduled last, g1, goes back to the queue with its 6 tokens. g0 ends at pos 10 (t = 10.2); g1 restarts with
    # a 7-token re-prefill (0.7 s) and its last 4 tokens end at 14.9; the step trains 14.9-15.9
    timing = LinearTiming(decode_base_s=1.0, train_base_s=1.0, prefill_per_token_s=0.1)
    c = cfg("sync", max_version_lag=0, slots_per_group=2, samples_per_prompt=1, prompts_per_step=2, total_steps=1)
    r = simulate(c, _scripted([10, 10], 10), timing, seed=0, kv_capacity_tokens=14)
    finished = {e["traj"]: e["t"] for e in r.events if e["type"] == "finished"}
    assert finished == pytest.approx({"g0/0": 10.2, "g1/0": 14.9})
    assert r.preemptions == 1 and r.recomputed_tokens == 7 and [s.end_s for s in r.steps] == pytest.approx([15.9])
    roomy = simulate(c, _scripted([10, 10], 10), timing, seed=0, kv_capacity_tokens=22)
    assert roomy.preemptions == 0 and roomy.recomputed_tokens == 0
    assert [s.end_s for s in roomy.steps] == pytest.approx([11.2])


def test_a_request_migrated_to_an_engine_without_room_waits_there_without_its_kv():
    """Streaming with a tight KV cache (the run of the test below): every request migrated here finds its destination
    full, or was preempted at its source, so none sends its KV cache; each is re-prefilled when it starts. So the
    migration's cost per token changes nothing (sending KV that is then dropped made this run 1.6 s longer)."""
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=600, max_tokens=300), prompt_tokens=5)
    c = cfg("streaming", max_version_lag=2, num_rollout_groups=4, slots_per_group=8, prompts_per_step=5,
            samples_per_prompt=4, total_steps=5)
    runs = []
    for per_token in (0.0, 1e-2):
        t = LinearTiming(decode_base_s=0.01, decode_per_context_token_s=1e-5, train_base_s=0.4, weight_publish_s=0.1,
                         weight_load_trainer_s=0.3, weight_load_peer_s=0.1, prefill_per_token_s=0.001,
                         kv_migration_s_per_token=per_token)
        runs.append(simulate(c, w, t, seed=3, kv_capacity_tokens=400))
    free, costly = runs
    assert free.migrated_trajectories > 0 and free.recomputed_sequences > free.preemptions
    assert costly.total_time_s == free.total_time_s and costly.recomputed_tokens == free.recomputed_tokens


class _ContextLog(LinearTiming):
    """LinearTiming that remembers the largest context a decode step was evaluated at."""

    most: float = 0.0

    def decode_step_s(self, batch_size: int, total_context_tokens: float) -> float:
        _ContextLog.most = max(_ContextLog.most, total_context_tokens)
        return super().decode_step_s(batch_size, total_context_tokens)


def _simulate_kv_limited(mode, colocated, versions, log, **kw):
    """4 engines of 8 slots, a long tail (the longest sequence takes 305 tokens), 5 steps, timed by ``log`` (its
    ``most`` context reset first)."""
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=600, max_tokens=300), prompt_tokens=5)
    c = cfg(mode, max_version_lag=0 if mode == "sync" else 2, num_rollout_groups=4, slots_per_group=8,
            prompts_per_step=5, samples_per_prompt=4, total_steps=5, allow_version_mixing=mode == "partial-rollout",
            colocated=colocated, max_versions_per_engine=versions)
    t = log(decode_base_s=0.01, decode_per_context_token_s=1e-5, train_base_s=0.4, weight_publish_s=0.1,
            weight_load_trainer_s=0.3, weight_load_peer_s=0.1, prefill_per_token_s=0.001, kv_migration_s_per_token=1e-5)
    log.most = 0.0
    return simulate(c, w, t, seed=3, **kw)


def _check_kv_limited_run(r, mode, k):
    """What every ``_simulate_kv_limited`` run keeps: the three constraints, all 5 steps of 5 groups of 4 trained, every
    started trajectory consumed or left unfinished, and no mixing outside the modes that mix."""
    rep = check_trace(list(r.events), k=k, allow_version_mixing=True)
    assert rep.ok, rep.violations[:3]
    assert len(r.steps) == 5 and rep.num_consumed == 5 * 5 * 4
    assert rep.num_trajectories == rep.num_consumed + len(rep.unfinished_at_end)
    if mode != "partial-rollout" and mode != "bounded-async":
        assert r.mixed_trajectories == 0


@pytest.mark.parametrize("mode,colocated,versions", [
    ("sync", False, 1), ("one-step-off", False, 1), ("bounded-async", False, 1), ("partial-rollout", False, 1),
    ("streaming", False, 1), ("streaming", True, 1), ("streaming", False, 3)])
def test_every_mode_keeps_its_engines_within_their_kv_cache(mode, colocated, versions):
    """A 400-token KV cache per engine of 8 slots, where the longest sequence takes 305: engines preempt, and still
    nothing is lost, mixed or run beyond the cache."""
    k = 0 if mode == "sync" else 2
    r = _simulate_kv_limited(mode, colocated, versions, _ContextLog, kv_capacity_tokens=400)
    assert r.preemptions > 0 and _ContextLog.most <= 400
    _check_kv_limited_run(r, mode, k)


def test_a_rank_whose_cache_fills_preempts_its_own_sequences_whatever_room_the_others_have():
    # sync, one engine of 2 attention data-parallel ranks (2 slots and half the 24-token KV cache, 12, each), one group
    # of 4 sequences of a 1-token prompt, lengths 10, 2, 10, 2; decode 1 s, prefill 0.1 s per token. vLLM's DP load
    # balancer (lowest 4 x waiting + running, first on a tie) puts them on ranks 0, 1, 0, 1, so both 10-token ones
    # share rank 0. They start at 0.1; rank 1's end at pos 2; rank 0's context 2 x (1 + pos) reaches 12 at pos 5
    # (t = 5.1), and rank 0 preempts g0/2, scheduled last, with 5 tokens, though the replica's 24 hold all 12 (rank 1
    # is empty). g0/0 ends at 10.1; g0/2 restarts on rank 0 after a 6-token re-prefill (0.6 s), its last 5 tokens end
    # at 15.7, and the step trains 15.7-16.7. One rank of the whole cache never preempts: it trains 10.1-11.1.
    timing = LinearTiming(decode_base_s=1.0, train_base_s=1.0, prefill_per_token_s=0.1)
    c = cfg("sync", max_version_lag=0, slots_per_group=4, samples_per_prompt=4, prompts_per_step=1, total_steps=1)
    ranks = simulate(c, _scripted([10, 2, 10, 2], 10), timing, seed=0, kv_capacity_tokens=24, attention_dp=2)
    finished = {e["traj"]: e["t"] for e in ranks.events if e["type"] == "finished"}
    assert finished == pytest.approx({"g0/0": 10.1, "g0/1": 2.1, "g0/2": 15.7, "g0/3": 2.1})
    assert ranks.preemptions == 1 and ranks.recomputed_tokens == 6 and [s.end_s for s in ranks.steps] == pytest.approx(
        [16.7])
    pooled = simulate(c, _scripted([10, 2, 10, 2], 10), timing, seed=0, kv_capacity_tokens=24)
    assert pooled.preemptions == 0 and [s.end_s for s in pooled.steps] == pytest.approx([11.1])


def test_ranks_decode_at_the_pace_of_the_busiest():
    # one engine of 2 ranks, lengths 10, 2, 10, 2 as above (no KV limit): ranks 0, 1, 0, 1. A step takes 1 s plus 1 s
    # per sequence on the busiest rank (LinearTiming.decode_step_ranks_s): 3 s while each rank holds 2 (pos 0-2, to
    # t = 6), and still 3 s once rank 0 holds both long ones (pos 2-10, to t = 30): the other rank idles
    timing = LinearTiming(decode_base_s=1.0, decode_per_seq_s=1.0, train_base_s=1.0)
    c = cfg("sync", max_version_lag=0, slots_per_group=4, samples_per_prompt=4, prompts_per_step=1, total_steps=1)
    r = simulate(c, _scripted([10, 2, 10, 2], 10), timing, seed=0, attention_dp=2)
    finished = {e["traj"]: e["t"] for e in r.events if e["type"] == "finished"}
    assert finished == pytest.approx({"g0/0": 30.0, "g0/1": 6.0, "g0/2": 30.0, "g0/3": 6.0})
    # lengths 10, 10, 2, 2 put a long one on each rank: after pos 2 each rank holds 1 and a step takes 2 s (to t = 22)
    even = simulate(c, _scripted([10, 10, 2, 2], 10), timing, seed=0, attention_dp=2)
    assert max(e["t"] for e in even.events if e["type"] == "finished") == pytest.approx(6.0 + 8 * 2.0)


class _RankContextLog(LinearTiming):
    """LinearTiming that remembers the largest rank context a decode step was evaluated at."""

    most: float = 0.0

    def decode_step_ranks_s(self, batch_size: int, busiest_batch: int, busiest_context_tokens: float) -> float:
        _RankContextLog.most = max(_RankContextLog.most, busiest_context_tokens)
        return super().decode_step_ranks_s(batch_size, busiest_batch, busiest_context_tokens)


@pytest.mark.parametrize("mode,colocated,versions", [
    ("sync", False, 1), ("one-step-off", False, 1), ("bounded-async", False, 1), ("partial-rollout", False, 1),
    ("streaming", False, 1), ("streaming", True, 1), ("streaming", False, 3)])
def test_every_mode_keeps_each_rank_within_its_share_of_the_kv_cache(mode, colocated, versions):
    """As the test above, with engines of 2 attention data-parallel ranks of 4 slots and 400 KV tokens each (800 per
    engine): ranks preempt, every rank stays within its 400, and nothing is lost or mixed."""
    k = 0 if mode == "sync" else 2
    r = _simulate_kv_limited(mode, colocated, versions, _RankContextLog, kv_capacity_tokens=800, attention_dp=2)
    assert r.preemptions > 0 and 0 < _RankContextLog.most <= 400
    _check_kv_limited_run(r, mode, k)
    pooled = _simulate_kv_limited(mode, colocated, versions, _RankContextLog, kv_capacity_tokens=800)
    assert pooled.preemptions < r.preemptions  # one cache of 800 holds what two of 400 do not


def test_a_preempted_sequence_is_recomputed_after_a_colocated_step_not_during_it():
    # colocated streaming, one engine of 2 slots, a 14-token KV cache; decode 1 s, prefill 0.1 s per token, swaps 1 s.
    # As above, g1 is preempted at t = 6.2 with 6 tokens and g0 ends at 10.2, which makes step 1 ready: swap-out
    # 10.2-11.2, train 11.2-12.2, swap-in 12.2-13.2. Only then is g1's KV cache recomputed (0.7 s), and its last 4
    # tokens end at 17.9 (the re-prefill used to run at 10.2, while rollout was stopping, and g1 ended at 17.2)
    timing = LinearTiming(decode_base_s=1.0, train_base_s=1.0, prefill_per_token_s=0.1, swap_fixed_s=1.0)
    c = cfg("streaming", colocated=True, slots_per_group=2, samples_per_prompt=1, total_steps=2)
    r = simulate(c, _scripted([10, 10], 10), timing, seed=0, kv_capacity_tokens=14)
    times = {(e["type"], e.get("traj")): e["t"] for e in r.events}
    assert times[("rollout_resumed", None)] == pytest.approx(13.2)
    assert times[("finished", "g1/0")] == pytest.approx(13.2 + 0.7 + 4)
    assert r.preemptions == 1 and r.recomputed_tokens == 7


def test_one_step_off_admitting_on_an_older_version_makes_it_live_again():
    # weight loads (20 s) outlast a training step and its publish (6 s): batch 3 is admitted on v1 at 27, after v2
    # was published at 13, so v1 is live again beside v2 (the timeline used to keep only v2)
    timing = dataclasses.replace(HAND, weight_load_trainer_s=20.0)
    r = simulate(cfg("one-step-off", total_steps=4), FIXED, timing, seed=0)
    admitted = {e["traj"].split("/")[0]: (e["t"], e["version"]) for e in r.events if e["type"] == "admitted"}
    assert admitted["g2"] == pytest.approx((27.0, 1))
    assert (27.0, (1, 2)) in r.live_versions and r.max_live_versions == 2


@pytest.mark.parametrize(("mode", "k"), [("sync", 0), ("one-step-off", 1)])
def test_an_engine_loading_new_weights_in_place_serves_no_version_meanwhile(mode: str, k: int):
    c = cfg(mode, max_version_lag=k, num_rollout_groups=2, slots_per_group=2, prompts_per_step=2, total_steps=3)
    assert simulate(c, FIXED, HAND, seed=0).max_engine_versions == 1


def test_an_update_before_a_requests_first_token_does_not_mix_versions():
    # partial-rollout, one slot, a 10-token prompt (1 s prefill), decode 1 s, train 0.5 s, load 0.5 s. g0 (2 tokens)
    # ends at 3; step 1 trains 3-3.5 while g1's prompt is prefilled (3-4); v1's load interrupts g1 at 3.5, before
    # its first token: all 5 of its tokens come from v1. Its trace keeps the empty v0 span, and nothing counts as mixed
    timing = LinearTiming(decode_base_s=1.0, prefill_per_token_s=0.1, train_base_s=0.5, weight_load_trainer_s=0.5)
    c = cfg("partial-rollout", samples_per_prompt=1, slots_per_group=1, total_steps=2, allow_version_mixing=True)
    r = simulate(c, _scripted([2, 5], 5, prompt_tokens=10), timing, seed=0)
    spans = {e["traj"]: e["spans"] for e in r.events if e["type"] == "finished"}
    assert spans["g1/0"] == [[0, 0], [1, 5]]
    assert r.mixed_trajectories == 0
    # the load, asked for at 3.5, starts when the prefill it waits behind ends (the trace said 3.5)
    assert [e["t"] for e in r.events if e["type"] == "weights_load_started"] == pytest.approx([4.0])
    report = check_trace(list(r.events), k=1, allow_version_mixing=False)
    assert report.ok and report.mixed == ()


@pytest.mark.parametrize("arrives", [True, False])
def test_streaming_never_switches_an_engine_that_awaits_migrated_requests(arrives: bool) -> None:
    """The runtime reports RequestsMigrated only once the source has exported, and other engines' finishes come in
    meanwhile (the simulator reports it at once). A destination that drained its own requests in that window looked
    empty and was switched to the newest version: the old version's request then arrived at an engine loading other
    weights (the torch engine refuses it; the policy's counts went negative)."""
    from planner.policies import (
        LoadWeights,
        PolicyConfig,
        RequestsMigrated,
        TrainStepFinished,
        TrajectoryFinished,
        WeightsPublished,
        make_policy,
    )

    p = make_policy(PolicyConfig(mode="streaming", max_version_lag=1, num_rollout_groups=2, slots_per_group=2,
                                 prompts_per_step=2, samples_per_prompt=1, total_steps=3))
    p.start()  # g0, g1 on engine 0; g2, g3 on engine 1

    def done(group: int, engine: int) -> list:
        return list(p.handle(TrajectoryFinished(group_id=group, sample=0, rollout_group=engine, num_tokens=1)))

    done(0, 0)
    done(2, 1)
    p.handle(TrainStepFinished(step=1))
    assert [type(a).__name__ for a in p.handle(WeightsPublished(version=1))] == ["MigrateRequests"]  # g1: 0 -> 1
    assert not any(isinstance(a, LoadWeights) for a in done(3, 1))  # engine 1 drained, but g1 is on its way
    if arrives:
        actions = list(p.handle(RequestsMigrated(src=0, moves=((1, 1),))))
        assert [(a.rollout_group, a.version) for a in actions if isinstance(a, LoadWeights)] == [(0, 1)]
        assert [(a.rollout_group, a.version) for a in done(1, 1) if isinstance(a, LoadWeights)] == [(1, 1)]
    else:  # g1 finished on engine 0 before the export: nothing arrives, and both engines are empty
        done(1, 0)
        actions = list(p.handle(RequestsMigrated(src=0, moves=())))
        assert sorted((a.rollout_group, a.version) for a in actions if isinstance(a, LoadWeights)) == [(0, 1), (1, 1)]
    assert min(p.version_active.values()) >= 0 and p.engine_version == [1, 1]


def test_sync_by_hand_with_a_controller_round_trip():
    """Each batch reaches the policy 0.5 s after its last finish (the engine is empty: the poll returns at once), so
    each training step starts 0.5 s later than in ``test_sync_by_hand``: steps end at 6.5, 16, 25.5."""
    r = simulate(cfg("sync", max_version_lag=0), FIXED, dataclasses.replace(HAND, report_round_trip_s=0.5), seed=0)
    assert [s.start_s for s in r.steps] == pytest.approx([1.5, 11.0, 20.5])
    assert [s.end_s for s in r.steps] == pytest.approx([6.5, 16.0, 25.5])


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_poll_lingers_for_a_groups_worth_and_one_report_travels_at_a_time(in_flight: bool):
    """Sync, one group of two samples finishing at t_a < t_b, polls of a group's worth (2) lingering 10 ms: the first
    finish waits 10 ms, alone, and is reported then. If the second comes after that report has reached the policy, it
    is reported when it finishes (the engine is empty); if it comes while that report travels, the next poll finds it
    when it arrives, one round trip after the first report left, and returns it at once. The step starts one round
    trip after the last report left."""
    from planner.policies import poll_batching

    c = cfg("sync", max_version_lag=0, total_steps=1)
    linger, batch = poll_batching(c)
    assert (linger, batch) == (0.01, 2)
    w = Workload(response_length=LengthDistribution.lognormal(median=50, p99=500, max_tokens=1000), prompt_tokens=10)
    base = dataclasses.replace(HAND, weight_load_trainer_s=0.0)
    ends = sorted(e["t"] for e in simulate(c, w, base, seed=3).events if e["type"] == "finished")
    t_a, t_b = ends
    assert t_b - t_a > 0.05  # the seed draws two lengths at least 5 steps apart
    rt = t_b - t_a + 0.2 if in_flight else 0.01
    r = simulate(c, w, dataclasses.replace(base, report_round_trip_s=rt), seed=3)
    assert sorted(e["t"] for e in r.events if e["type"] == "finished") == pytest.approx(ends)  # the engine is unchanged
    last_report = t_a + linger + rt if in_flight else t_b
    assert r.steps[0].start_s == pytest.approx(last_report + rt)


def test_streaming_migrates_with_a_controller_round_trip_and_keeps_every_constraint():
    """A migration's source reports what finished before its requests move (the runtime's export reply carries it):
    the policy's count of the source's requests is then exact, and the migration goes through."""
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=1500, max_tokens=2000), prompt_tokens=5)
    c = cfg("streaming", max_version_lag=3, num_rollout_groups=6, slots_per_group=16, prompts_per_step=6,
            samples_per_prompt=4, total_steps=8, admission_queue=8)
    t = LinearTiming(decode_base_s=0.01, train_base_s=1.0, weight_load_trainer_s=0.5, weight_load_peer_s=0.2,
                     report_round_trip_s=0.05)
    r = simulate(c, w, t, seed=11)
    assert r.migrated_trajectories > 0
    assert check_trace(list(r.events), k=3, allow_version_mixing=False).ok
    instant = simulate(c, w, dataclasses.replace(t, report_round_trip_s=0.0), seed=11)
    assert r.rollout_slot_occupancy < instant.rollout_slot_occupancy  # the freed slots idle through the round trip


def _early_runs(mode: str, **kw):
    """One workload run twice on separate accelerators, the trainer waiting at the bound, or starting early."""
    w = Workload(response_length=LengthDistribution.lognormal(median=40, p99=1500, max_tokens=2000), prompt_tokens=5)
    timing = LinearTiming(decode_base_s=0.01, train_base_s=0.5, train_per_token_s=2e-4, weight_publish_s=0.05,
                          weight_load_trainer_s=0.1, weight_load_peer_s=0.05, **kw)
    cfg = PolicyConfig(mode=mode, max_version_lag=1, num_rollout_groups=4, slots_per_group=16, prompts_per_step=8,
                       samples_per_prompt=4, total_steps=12)
    waits = simulate(cfg, w, timing, seed=3, record_events=True)
    early = simulate(dataclasses.replace(cfg, early_steps=True), w, timing, seed=3, record_events=True)
    return cfg, timing, waits, early


@pytest.mark.parametrize("mode", ["streaming", "bounded-async"])
def test_early_steps_train_the_finished_groups_while_the_tail_finishes(mode):
    cfg, timing, waits, early = _early_runs(mode)
    steps = [e for e in early.events if e["type"] == "train_step"]
    joining = [e for e in steps if e.get("joined")]
    assert joining, "no step started early: the scenario must make the trainer wait at the bound"
    assert not any(e.get("joined") for e in waits.events if e["type"] == "train_step")
    finished = {e["traj"]: e["t"] for e in early.events if e["type"] == "finished"}
    for e in joining:
        for traj, t in e["joined"].items():  # a group joins when its last trajectory finishes, during the step
            group = traj.split("/")[0]
            assert t == max(f for tr, f in finished.items() if tr.split("/")[0] == group)
            assert finished[traj] <= t and e["start_t"] < t <= e["t"]
        # after the last group joins, the step still trains that group as a step of its own
        last = max(e["joined"].values())
        assert e["t"] >= last + timing.train_base_s - 1e-9
    for run in (waits, early):
        rep = check_trace(list(run.events), k=1, allow_version_mixing=False)
        assert rep.ok, rep.violations[:3]
        assert rep.num_consumed == cfg.total_steps * cfg.batch_samples
    # the wait for the tail overlaps the rest of the step: fewer seconds per step, the same batches' sizes
    assert early.step_time_s < waits.step_time_s
    assert sum(s.trainer_wait_s for s in early.steps) < sum(s.trainer_wait_s for s in waits.steps)


def test_early_steps_keep_the_training_contention_accounting():
    """On one host (cpu) a training step slows while an engine decodes: an early step's trainer, idle between joining
    groups, resumes at the contended rate, and its busy time stays within the run."""
    _, _, waits, early = _early_runs("streaming", rollout_contention=1.3, train_contention=1.5)
    assert any(e.get("joined") for e in early.events if e["type"] == "train_step")
    assert 0.0 < early.train_busy_fraction <= 1.0
    assert check_trace(list(early.events), k=1, allow_version_mixing=False).ok


def test_early_steps_are_refused_where_the_trainer_cannot_take_groups_late():
    base = dict(max_version_lag=1, num_rollout_groups=2, slots_per_group=8, prompts_per_step=2, samples_per_prompt=2,
                total_steps=2, early_steps=True)
    for mode, colocated in (("sync", False), ("one-step-off", False), ("streaming", True)):
        with pytest.raises(ValueError, match="early_steps"):
            PolicyConfig(mode=mode, colocated=colocated, **{**base, "max_version_lag": 0 if mode == "sync" else 1})
