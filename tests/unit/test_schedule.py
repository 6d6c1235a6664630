import json
import re

import pytest

from planner.schedule import (
    TraceError,
    build_schedule_graph,
    check_trace,
    graph_to_dot,
    graph_to_json,
    parse_trace,
    parse_traj_id,
    timeline_html,
)


def adm(t, traj, v, rg=0):
    return {"t": t, "type": "admitted", "traj": traj, "version": v, "rollout_group": rg}


def fin(t, traj, spans, rg=0):
    return {"t": t, "type": "finished", "traj": traj, "num_tokens": sum(n for _, n in spans),
            "spans": [list(s) for s in spans], "rollout_group": rg}


def step(t, s, consumed, start=None):
    return {"t": t, "type": "train_step", "step": s, "start_t": t if start is None else start,
            "consumed": consumed, "produced_version": s}


def clean_trace():
    return [
        adm(0, "g0/0", 0), adm(0, "g0/1", 0), fin(1, "g0/0", [(0, 5)]), fin(2, "g0/1", [(0, 7)]),
        step(3, 1, ["g0/0", "g0/1"], start=2.5), {"t": 3.5, "type": "weights_published", "version": 1},
        adm(4, "g1/0", 1), {"t": 5, "type": "unfinished_at_end", "traj": "g1/0", "finished": False},
    ]


def test_clean_trace_passes_and_graph_has_the_edges():
    rep = check_trace(clean_trace(), k=0, allow_version_mixing=False)
    assert rep.ok and rep.num_consumed == 2 and rep.unfinished_at_end == ("g1/0",)
    assert rep.staleness_histogram == ((0, 2),)
    g = build_schedule_graph(clean_trace())
    assert g.edges[("version", 0), ("traj", "g0/0")]["kind"] == "generated"
    assert g.edges[("traj", "g0/0"), ("step", 1)]["kind"] == "consumed"
    assert g.edges[("step", 1), ("version", 1)]["kind"] == "produced"


def test_consistency_violation_has_a_witness_unless_mixing_allowed():
    # step 1 (training nothing here) makes v1, ending before v1's tokens: the trace must be possible
    trace = [adm(0, "g0/0", 0), step(1, 1, []), fin(2, "g0/0", [(0, 3), (1, 4)]), step(3, 2, ["g0/0"])]
    rep = check_trace(trace, k=1, allow_version_mixing=False)
    (v,) = rep.of("consistency")
    assert v.traj == "g0/0" and v.versions == (0, 1) and "mixes versions [0, 1]" in v.message
    lenient = check_trace(trace, k=1, allow_version_mixing=True)
    assert lenient.ok and lenient.mixed == ("g0/0",)


def test_staleness_uses_oldest_span_and_reports_step():
    trace = [adm(0, "g0/0", 0), step(1, 1, []), step(1.5, 2, []), fin(2, "g0/0", [(0, 3), (2, 4)]),
             step(3, 3, ["g0/0"])]
    rep = check_trace(trace, k=1, allow_version_mixing=True)
    (v,) = rep.of("staleness")
    assert v.step == 3 and "lag 2 exceeds k=1" in v.message
    assert not check_trace(trace, k=2, allow_version_mixing=True).violations


def test_integrity_violations():
    base = [adm(0, "g0/0", 0), adm(0, "g0/1", 0), fin(1, "g0/0", [(0, 3)]), fin(1, "g0/1", [(0, 3)])]
    dropped = check_trace(base + [step(2, 1, ["g0/0"])], k=0, allow_version_mixing=False)
    assert [v.traj for v in dropped.of("integrity")] == ["g0/1"]
    assert "never consumed" in dropped.of("integrity")[0].message
    twice = check_trace(base + [step(2, 1, ["g0/0", "g0/1"]), step(3, 2, ["g0/0"])], k=1,
                        allow_version_mixing=False)
    (v,) = twice.of("integrity")
    assert v.traj == "g0/0" and "step 1, consumed by step 2" in v.message
    early = check_trace([adm(0, "g0/0", 0), step(2, 1, ["g0/0"]), fin(3, "g0/0", [(0, 3)])], k=0,
                        allow_version_mixing=False)
    assert "before it finished" in early.of("integrity")[0].message
    # an early step takes a trajectory that finishes after its start, at the time the step records it joined
    joined = {**step(4, 1, ["g0/0"], start=2), "joined": {"g0/0": 3}}
    assert check_trace([adm(0, "g0/0", 0), fin(3, "g0/0", [(0, 3)]), joined], k=0, allow_version_mixing=False).ok
    too_soon = {**joined, "joined": {"g0/0": 2.5}}
    rep = check_trace([adm(0, "g0/0", 0), fin(3, "g0/0", [(0, 3)]), too_soon], k=0, allow_version_mixing=False)
    assert "consumed by step 1 at t=2.5 before it finished (t=3)" in rep.of("integrity")[0].message
    ghost = check_trace([step(2, 1, ["g9/9"])], k=0, allow_version_mixing=False)
    assert "never admitted" in ghost.of("integrity")[0].message
    discarded = base + [step(2, 1, ["g0/0"]), {"t": 2, "type": "discarded", "traj": "g0/1", "reason": "bad reward"}]
    rep = check_trace(discarded, k=0, allow_version_mixing=False)
    assert rep.ok and rep.discarded == ("g0/1",)


def test_regenerated_trajectory_restarts_its_spans():
    trace = [adm(0, "g0/0", 0), step(0.5, 1, []), {"t": 1, "type": "regenerated", "traj": "g0/0", "version": 1},
             adm(1, "g0/0", 1), fin(2, "g0/0", [(1, 5)]), step(3, 2, ["g0/0"])]
    assert check_trace(trace, k=0, allow_version_mixing=False).ok


def test_regenerated_supersedes_an_earlier_discard():
    """A discarded trajectory generated again is accounted for by its new attempt alone (as the runtime's ledger
    counts it): consumed once it is clean, and lost when the new attempt never finishes."""
    discard = {"t": 2, "type": "discarded", "traj": "g0/1", "reason": "bad reward"}
    again = [discard, {"t": 2.1, "type": "regenerated", "traj": "g0/1", "version": 0}, adm(2.1, "g0/1", 0)]
    base = [adm(0, "g0/0", 0), adm(0, "g0/1", 0), fin(1, "g0/0", [(0, 5)]), fin(1.5, "g0/1", [(0, 6)]), *again]
    used = check_trace(base + [fin(2.4, "g0/1", [(0, 7)]), step(3, 1, ["g0/0", "g0/1"], start=2.5)], k=0,
                       allow_version_mixing=False)
    assert used.ok and used.discarded == () and used.num_consumed == 2
    lost = check_trace(base + [step(3, 1, ["g0/0"], start=2.5)], k=0, allow_version_mixing=False)
    (v,) = lost.violations
    assert v.traj == "g0/1" and "never consumed, discarded or accounted for" in v.message
    dropped_again = check_trace(base + [fin(2.4, "g0/1", [(0, 7)]), {**discard, "t": 2.5},
                                        step(3, 1, ["g0/0"], start=2.5)], k=0, allow_version_mixing=False)
    assert dropped_again.ok and dropped_again.discarded == ("g0/1",)


@pytest.mark.parametrize(
    ("event", "match"),
    [
        ({"t": 0, "type": "admited", "traj": "g0/0"}, "unknown type 'admited'"),
        ({"t": -1, "type": "weights_published", "version": 1}, "'t' must be a finite number"),
        ({"t": 0, "type": "admitted", "traj": "0/1", "version": 0, "rollout_group": 0}, "'traj' must"),
        ({"t": 0, "type": "admitted", "traj": "g0/1", "version": True, "rollout_group": 0}, "'version' must be an integer"),
        ({"t": 0, "type": "admitted", "traj": "g0/1", "version": 0}, "missing field 'rollout_group'"),
        ({"t": 0, "type": "weights_published", "version": 1, "extra": 1}, "unknown field 'extra'"),
        ({"t": 1, "type": "finished", "traj": "g0/1", "num_tokens": 5, "spans": [[0, 4]], "rollout_group": 0},
         "spans sum to 4"),
        ({"t": 1, "type": "train_step", "step": 2, "start_t": 0, "consumed": [], "produced_version": 3},
         "must produce version 2"),
        ("not a dict", "must be an object"),
        ({"t": 2, "type": "train_step", "step": 1, "start_t": 1, "consumed": ["g0/0"], "produced_version": 1,
          "joined": {"g0/0": 3}}, r"g0/0 joined at t=3, outside the step \[1, 2\]"),
        ({"t": 2, "type": "train_step", "step": 1, "start_t": 1, "consumed": [], "produced_version": 1,
          "joined": {"g0/0": 1.5}}, "g0/0 joined step 1 but is not consumed"),
        ({"t": 2, "type": "train_step", "step": 1, "start_t": 1, "consumed": [], "produced_version": 1,
          "joined": [1]}, "'joined' must map trajectory ids to times"),
    ],
)
def test_parser_rejects_malformed_events_with_index(event, match):
    with pytest.raises(TraceError, match=match) as err:
        parse_trace([{"t": 0, "type": "weights_published", "version": 0}, event])
    assert "events[1]" in str(err.value)


def test_parser_collects_all_problems():
    with pytest.raises(TraceError) as err:
        parse_trace([{"t": 0, "type": "x"}, {"type": "weights_published", "version": "1"}])
    assert len(err.value.problems) == 3


def test_exports():
    g = build_schedule_graph(clean_trace())
    text = graph_to_json(g)
    data = json.loads(text)
    # compact, so json's C encoder writes it (an indent made a large run's graph 2-5x slower and 30% bigger)
    assert text == json.dumps(data, sort_keys=True, separators=(",", ":")) and "\n" not in text
    assert {n["id"] for n in data["nodes"]} >= {"v0", "v1", "step1", "g0/0"}
    assert graph_to_json(g) == graph_to_json(build_schedule_graph(clean_trace()))
    dot = graph_to_dot(g)
    assert dot.startswith("digraph schedule {") and '"v0" -> "g0/0"' in dot
    page = timeline_html(clean_trace(), title="t<1>")
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "t&lt;1&gt;" in page and "s1" in page


def test_timeline_rows_grey_the_suspended_spans_and_keep_every_long_span_whole():
    """A colocated streaming run: every replica counts as loading from each suspension to its resume (or the end), and
    a span many columns long is spread over all of them."""
    from planner.policies import PolicyConfig
    from planner.schedule.export import _occupancy_rows
    from planner.sim import LinearTiming, simulate
    from planner.workload import LengthDistribution, Workload

    fixed = Workload(response_length=LengthDistribution.lognormal(median=100, p99=100, max_tokens=1000), prompt_tokens=10)
    timing = LinearTiming(decode_base_s=0.01, train_base_s=5.0, weight_publish_s=1.0, weight_load_trainer_s=2.0,
                          swap_fixed_s=0.1, swap_s_per_version=0.2, swap_s_per_token=0.001)
    cfg = PolicyConfig(mode="streaming", max_version_lag=1, num_rollout_groups=1, slots_per_group=4,
                       prompts_per_step=1, samples_per_prompt=2, total_steps=3, colocated=True)
    r = simulate(cfg, fixed, timing, seed=0)  # suspended 1.52-13.82 and 17.34-22.34, loading v2 13.82-15.82
    end, columns = r.total_time_s, 100
    area, _, loading = _occupancy_rows(list(r.events), 1, end, columns)
    width = end / columns
    assert sum(loading[0]) * width == pytest.approx((13.82 - 1.52) + (15.82 - 13.82) + (end - 17.34))
    assert sum(area[0]) * width == pytest.approx(8.0)  # 4 sequences 0-1 s, 4 more 15.82-16.82 s


def pub(t, v):
    return {"t": t, "type": "weights_published", "version": v}


def test_a_second_finish_without_regenerated_is_reported_and_the_edges_follow_the_spans():
    """A second ``finished`` of one attempt once silently replaced the first, and the version edges kept the first's
    tokens beside the second's (v0 10 tokens, v1 4, for a node whose spans were [(0, 7)])."""
    trace = [adm(0, "g0/0", 0), fin(1, "g0/0", [(0, 3)]), fin(2, "g0/0", [(0, 7)]), step(3, 1, ["g0/0"], start=2.5)]
    (v,) = check_trace(trace, k=0, allow_version_mixing=False).violations
    assert v.constraint == "integrity" and v.traj == "g0/0"
    assert v.message == "g0/0 finished 2 times without a 'regenerated' between (t=1, t=2)"
    mixed_first = [adm(0, "g0/0", 0), step(0.5, 1, []), fin(1, "g0/0", [(0, 3), (1, 4)]), fin(2, "g0/0", [(0, 7)]),
                   step(3, 2, ["g0/0"], start=2.5)]
    g = build_schedule_graph(mixed_first)
    node = g.nodes[("traj", "g0/0")]
    edges = {u[1]: data["tokens"] for u, _, data in g.in_edges(("traj", "g0/0"), data=True) if u[0] == "version"}
    assert node["spans"] == [(0, 7)] and edges == {0: 7}
    # a regeneration between two finishes is a new attempt: each finishes once
    regen = [adm(0, "g0/0", 0), fin(1, "g0/0", [(0, 3)]), {"t": 1.5, "type": "regenerated", "traj": "g0/0",
             "version": 0}, adm(1.5, "g0/0", 0), fin(2, "g0/0", [(0, 7)]), step(3, 1, ["g0/0"], start=2.5)]
    assert check_trace(regen, k=0, allow_version_mixing=False).ok


def test_a_step_number_recorded_twice_is_reported_and_each_event_checked_against_its_own_start():
    """The second ``train_step 1`` once overwrote the first's ``start_t``, hiding that the first consumed g0/0 before it
    finished; the repeat itself went unreported."""
    trace = [adm(0, "g0/0", 0), adm(0, "g0/1", 0), step(2, 1, ["g0/0"], start=1), fin(3, "g0/0", [(0, 5)]),
             fin(3, "g0/1", [(0, 5)]), step(6, 1, ["g0/1"], start=5)]
    rep = check_trace(trace, k=0, allow_version_mixing=False)
    assert [(v.traj, v.step, v.message) for v in rep.violations] == [
        ("", 1, "step 1 is recorded 2 times: train_step start_t=1 t=2 and start_t=5 t=6"),
        ("g0/0", 1, "g0/0 consumed by step 1 at t=1 before it finished (t=3)"),
    ]
    g = build_schedule_graph(trace)
    assert g.nodes[("step", 1)]["start_t"] == 1 and g.nodes[("step", 1)]["repeats"] == [(5, 6)]


def test_causality_admitted_then_finished_then_consumed():
    late = [fin(1, "g0/0", [(0, 5)]), step(3, 1, ["g0/0"], start=2), adm(5, "g0/0", 0)]
    rep = check_trace(late, k=0, allow_version_mixing=False)
    assert [v.message for v in rep.of("integrity")] == [
        "g0/0 finished (t=1) before it was admitted (t=5)",
        "g0/0 consumed by step 1 at t=2 before it was admitted (t=5)",
    ]
    assert rep.of("integrity")[1].step == 1


def test_causality_a_version_is_used_only_once_it_exists():
    """Admitted on, or generating with, a version no step had produced (or that was published later) is impossible."""
    base = [adm(0, "g0/1", 0), fin(1, "g0/1", [(0, 4)]), adm(0, "g0/2", 0), fin(1, "g0/2", [(0, 4)]),
            step(5, 1, ["g0/1"], start=4), pub(5.5, 1), step(9, 2, ["g0/2"], start=8), pub(9.5, 2)]
    early = base + [adm(0, "g0/0", 2), fin(1, "g0/0", [(2, 5)]), step(12, 3, ["g0/0"], start=11)]
    rep = check_trace(early, k=1, allow_version_mixing=False)
    assert [(v.constraint, v.traj, v.versions, v.message) for v in rep.violations] == [
        ("integrity", "g0/0", (2,), "g0/0 was admitted on v2 at t=0, before v2 existed: step 2, which produces it, "
                                    "ended at t=9"),
        ("integrity", "g0/0", (2,), "g0/0 finished with tokens of v2 at t=1, before v2 existed: step 2, which "
                                    "produces it, ended at t=9"),
    ]
    never = [adm(0, "g0/0", 7), fin(1, "g0/0", [(7, 5)]), step(3, 8, ["g0/0"], start=2)]
    assert "before v7 existed: no train_step produces v7" in check_trace(
        never, k=0, allow_version_mixing=False).violations[0].message
    # produced, but published after the admission
    unpublished = base + [adm(9.2, "g1/0", 2), fin(10, "g1/0", [(2, 5)]), step(12, 3, ["g1/0"], start=11)]
    (v,) = check_trace(unpublished, k=1, allow_version_mixing=False).violations
    assert v.message == "g1/0 was admitted on v2 at t=9.2, before v2 existed: v2 was published at t=9.5"
    on_time = base + [adm(9.5, "g1/0", 2), fin(10, "g1/0", [(2, 5)]), step(12, 3, ["g1/0"], start=11)]
    assert check_trace(on_time, k=1, allow_version_mixing=False).ok


def test_causality_accepts_a_resumed_run_whose_base_version_was_never_published():
    """Killed between step 1's commit and its publish: the resume wrote step 1's event from the checkpoint and the
    leftovers' ``unfinished_at_end``; the new attempt regenerates g1 on v1 (the controller publishes its base version
    at start-up, untraced). The regenerated attempt is judged from its own admission, not the first one at t=0.5."""
    trace = [
        {"t": 0, "type": "run_config", "mode": "one-step-off", "k": 1, "allow_version_mixing": False,
         "num_rollout_groups": 1, "slots_per_group": 2},
        adm(0, "g0/0", 0), adm(0.5, "g1/0", 0), fin(1, "g0/0", [(0, 3)]), fin(2, "g1/0", [(0, 3)]),
        step(3, 1, ["g0/0"], start=1.5),
        {"t": 3, "type": "unfinished_at_end", "traj": "g1/0", "finished": True},
        {"t": 4, "type": "resumed", "step": 1},
        {"t": 4, "type": "regenerated", "traj": "g1/0", "version": 1}, adm(4, "g1/0", 1),
        fin(5, "g1/0", [(1, 3)]), step(7, 2, ["g1/0"], start=6), pub(7.5, 2),
    ]
    rep = check_trace(trace, k=1, allow_version_mixing=False)
    assert rep.ok, rep.violations
    assert rep.num_consumed == 2 and rep.unfinished_at_end == ()


def test_unfinished_at_end_must_say_whether_it_finished():
    never = [adm(0, "g0/0", 0), {"t": 3, "type": "unfinished_at_end", "traj": "g0/0", "finished": True}]
    (v,) = check_trace(never, k=0, allow_version_mixing=False).violations
    assert v.constraint == "integrity" and v.message == (
        "g0/0 is recorded unfinished_at_end at t=3 with finished=true, but it had not finished since it was last "
        "admitted")
    done = [adm(0, "g0/0", 0), fin(1, "g0/0", [(0, 3)]),
            {"t": 3, "type": "unfinished_at_end", "traj": "g0/0", "finished": False}]
    (v,) = check_trace(done, k=0, allow_version_mixing=False).violations
    assert v.message == "g0/0 is recorded unfinished_at_end at t=3 with finished=false, but it had finished (t=1)"
    # a regeneration starts over: not finished since
    regen = [adm(0, "g0/0", 0), fin(1, "g0/0", [(0, 3)]), {"t": 2, "type": "regenerated", "traj": "g0/0", "version": 0},
             adm(2, "g0/0", 0), {"t": 3, "type": "unfinished_at_end", "traj": "g0/0", "finished": False}]
    assert check_trace(regen, k=0, allow_version_mixing=False).ok


@pytest.mark.parametrize("traj", ["g\u00b2/0", "g\u0663/0", "g\uff11/0", "g0/\u0661", "g01/0", "g1/00", "g1/0\n"])
def test_trajectory_ids_are_ascii_digits_in_one_form(traj):
    """``str.isdigit`` took superscripts, Arabic-Indic and fullwidth digits: ``parse_traj_id`` then crashed or read
    'g٣/0' as g3/0, a second id for one trajectory (so would a leading zero)."""
    with pytest.raises(TraceError, match=r"events\[0\] \(admitted\): 'traj' must be a trajectory id 'g<group>/<sample>'"):
        parse_trace([adm(0, traj, 0)])
    with pytest.raises(TraceError, match=r"'consumed' has malformed trajectory ids"):
        parse_trace([step(1, 1, ["g0/0", traj])])
    with pytest.raises(TraceError, match="is not of the form 'g<group>/<sample>'"):
        parse_traj_id(traj)
    assert parse_traj_id("g12/3") == (12, 3) and parse_traj_id("g0/10") == (0, 10)


@pytest.mark.parametrize(
    ("event", "match"),
    [
        ({"slots_per_group": 0}, r"events\[0\] \(run_config\): 'slots_per_group' must be an integer >= 1, got 0"),
        ({"num_rollout_groups": 0}, r"events\[0\] \(run_config\): 'num_rollout_groups' must be an integer >= 1, got 0"),
    ],
)
def test_run_config_needs_a_group_and_a_slot(event, match):
    cfg = {"t": 0, "type": "run_config", "mode": "sync", "k": 0, "allow_version_mixing": False,
           "num_rollout_groups": 1, "slots_per_group": 1, **event}
    with pytest.raises(TraceError, match=match):
        timeline_html([cfg, adm(0, "g0/0", 0), fin(1, "g0/0", [(0, 1)])])


def test_every_rollout_group_named_must_be_one_of_the_header():
    cfg = {"t": 0, "type": "run_config", "mode": "sync", "k": 0, "allow_version_mixing": False,
           "num_rollout_groups": 2, "slots_per_group": 1}
    trace = [adm(0, "g0/0", 0, rg=2), {"t": 0.5, "type": "migrated", "src": 0, "dst": 3, "trajs": ["g0/0"]}, cfg]
    with pytest.raises(TraceError) as err:
        parse_trace(trace)
    assert err.value.problems == [
        "events[0] (admitted): 'rollout_group' 2 is not a rollout group of the run: events[2] (run_config) has "
        "num_rollout_groups 2 (groups 0..1)",
        "events[1] (migrated): 'dst' 3 is not a rollout group of the run: events[2] (run_config) has "
        "num_rollout_groups 2 (groups 0..1)",
    ]


def test_timeline_without_a_header_has_a_row_for_every_group_named():
    """Without run_config the rows came from rollout_group or dst only: a migration out of the highest group crashed."""
    from planner.schedule.export import _occupancy_rows

    trace = [adm(0, "g0/0", 0, rg=0), {"t": 0.5, "type": "migrated", "src": 2, "dst": 0, "trajs": []},
             fin(1, "g0/0", [(0, 1)]), step(2, 1, ["g0/0"], start=1.5)]
    page = timeline_html(trace)
    assert ">rg 2</text>" in page
    area, _, _ = _occupancy_rows(parse_trace(trace), 3, 2.0, 2)
    assert area == [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


def test_timeline_releases_a_group_on_regenerated_and_unfinished_at_end_and_follows_migrations():
    """A worker restart (regenerated + admitted) or an in-flight trajectory left at the end once kept its group busy
    for the rest of the run."""
    from planner.schedule.export import _occupancy_rows

    cfg = {"t": 0, "type": "run_config", "mode": "streaming", "k": 1, "allow_version_mixing": False,
           "num_rollout_groups": 2, "slots_per_group": 1}
    restart = [cfg, adm(0, "g0/0", 0), {"t": 1, "type": "worker_restarted", "rollout_group": 0, "version": 0},
               {"t": 1, "type": "regenerated", "traj": "g0/0", "version": 0}, adm(1, "g0/0", 0),
               fin(2, "g0/0", [(0, 5)]), step(10, 1, ["g0/0"], start=9)]
    area, _, _ = _occupancy_rows(parse_trace(restart), 2, 10.0, 10)
    assert area[0] == [1.0, 1.0] + [0.0] * 8
    page = timeline_html(restart, columns=10)
    assert page.count('fill="#4e79a7" fill-opacity') == 2
    left = [cfg, adm(0, "g0/0", 0), adm(0, "g0/1", 0, rg=1),
            {"t": 2, "type": "migrated", "src": 0, "dst": 1, "trajs": ["g0/0"]},
            {"t": 4, "type": "unfinished_at_end", "traj": "g0/0", "finished": False},
            {"t": 4, "type": "unfinished_at_end", "traj": "g0/1", "finished": False},
            {"t": 10, "type": "weights_published", "version": 0}]
    area, _, _ = _occupancy_rows(parse_trace(left), 2, 10.0, 10)
    assert area[0] == [1.0, 1.0] + [0.0] * 8
    assert area[1] == [1.0, 1.0, 2.0, 2.0] + [0.0] * 6


def test_timeline_colours_a_multi_version_engine_by_the_version_its_requests_use():
    """An engine that runs only v0's requests from t=0 to 10 and loads v1 at t=2 (admitting nothing on it) was drawn
    v1 from t=2 on: the colour followed the version loaded last. A request keeps its version when it migrates."""
    from planner.schedule.export import _occupancy_rows

    cfg = {"t": 0, "type": "run_config", "mode": "streaming", "k": 2, "allow_version_mixing": False,
           "num_rollout_groups": 2, "slots_per_group": 4}
    trace = [cfg, *[adm(0, f"g0/{i}", 0) for i in range(4)], step(1, 1, [], start=0.5), pub(1.5, 1),
             {"t": 1.5, "type": "weights_load_started", "rollout_group": 0, "version": 1, "source": "trainer"},
             {"t": 2, "type": "weights_loaded", "rollout_group": 0, "version": 1},
             adm(4, "g1/0", 1, rg=1), {"t": 6, "type": "migrated", "src": 1, "dst": 0, "trajs": ["g1/0"]},
             *[fin(10, f"g0/{i}", [(0, 50)]) for i in range(4)], fin(10, "g1/0", [(1, 50)]),
             {"t": 10, "type": "version_dropped", "rollout_group": 0, "version": 0}]
    area, version, _ = _occupancy_rows(parse_trace(trace), 2, 10.0, 10)
    assert version[0] == [0] * 10  # four v0 requests outweigh the migrated v1 one
    assert version[1] == [0] * 4 + [1, 1] + [0] * 4 and area[1] == [0.0] * 4 + [1.0, 1.0] + [0.0] * 4  # idle: 0
    page = timeline_html(trace, columns=10)
    assert page.count('fill="#f28e2b" fill-opacity') == 2  # v1's colour only where g1/0 ran on group 1


def test_timeline_draws_every_weight_load_however_short():
    """Loads shorter than half a column (0.8 s loads in 2 s columns) were not drawn at all."""
    import re

    ev = [{"t": 0, "type": "run_config", "mode": "one-step-off", "k": 1, "allow_version_mixing": False,
           "num_rollout_groups": 2, "slots_per_group": 1}]
    for s in (1, 2, 3):
        t = 400.0 * s
        ev.append(pub(t - 1, s))
        for rg in (0, 1):
            ev.append({"t": t, "type": "weights_load_started", "rollout_group": rg, "version": s, "source": "trainer"})
            ev.append({"t": t + 0.8, "type": "weights_loaded", "rollout_group": rg, "version": s})
    page = timeline_html(ev)
    grey = [(float(x), float(y)) for x, y in re.findall(r'<rect x="([0-9.]+)" y="([0-9.]+)"[^>]*fill="#888"', page)]
    width, left, end = 900, 90, 1200.8
    for s in (1, 2, 3):
        x0, x1 = left + 400.0 * s / end * width, left + (400.0 * s + 0.8) / end * width
        for y in {y for _, y in grey}:
            assert any(x0 - 2 <= x <= x1 for x, yy in grey if yy == y), (s, y)
    assert len({y for _, y in grey}) == 2


def test_timeline_axis_labels_are_distinct_on_short_runs():
    import re

    def ticks(end):
        page = timeline_html([adm(0, "g0/0", 0), fin(end, "g0/0", [(0, 1)])])
        return re.findall(r'text-anchor="middle">([^<]*)<', page)

    assert ticks(2) == ["0.0s", "0.4s", "0.8s", "1.2s", "1.6s", "2.0s"]
    assert ticks(0.01) == ["0.000s", "0.002s", "0.004s", "0.006s", "0.008s", "0.010s"]
    assert ticks(1000) == ["0s", "200s", "400s", "600s", "800s", "1000s"]


def test_dot_export_is_the_same_for_equivalent_traces_and_keeps_the_first_ids():
    a = [adm(0, "g0/0", 0), adm(0, "g0/1", 0), fin(1, "g0/0", [(0, 2)]), fin(1, "g0/1", [(0, 2)]),
         step(2, 1, ["g0/0", "g0/1"], start=1.5)]
    b = [a[1], a[0], a[3], a[2], step(2, 1, ["g0/1", "g0/0"], start=1.5)]
    assert graph_to_dot(build_schedule_graph(a)) == graph_to_dot(build_schedule_graph(b))
    c = [step(0.5, 1, [], start=0)] + [adm(0.1 * (11 - i), f"g{i}/0", 0) for i in range(12)]
    dot = graph_to_dot(build_schedule_graph(c), max_trajectories=3)
    assert [line.split('"')[1] for line in dot.splitlines() if "shape=point" in line] == ["g0/0", "g1/0", "g2/0"]


def test_finish_job_keeps_the_audit_and_summary_when_the_timeline_fails(tmp_path, monkeypatch):
    """A timeline crash once propagated out of finish_job: no summary.json, no audit."""
    import planner.schedule
    from dora.runtime.driver import finish_job

    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(e) + "\n" for e in clean_trace()))
    (tmp_path / "timeline.html").write_text("an earlier attempt's picture")

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(planner.schedule, "timeline_html", broken)
    result = finish_job(tmp_path, {"mode": "sync"}, k=0, allow_version_mixing=False, title="t")
    assert result.ok and result.audit["num_consumed"] == 2
    assert result.timeline_error == "drawing it failed: ZeroDivisionError: float division by zero"
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["audit"]["ok"] and written["timeline_error"] == result.timeline_error
    assert not (tmp_path / "timeline.html").exists()


def test_timeline_ticks_an_early_step_where_each_late_group_joined_it():
    """An early step's bar spans the trainer's waits for its late groups: a tick at each join says where they came."""
    joined = step(6, 1, ["g0/0", "g0/1", "g0/2"], start=2)
    joined["joined"] = {"g0/1": 4.0, "g0/2": 5.0}
    trace = [adm(0, "g0/0", 0), adm(0, "g0/1", 0), adm(0, "g0/2", 0), fin(1, "g0/0", [(0, 5)]),
             fin(4, "g0/1", [(0, 9)]), fin(5, "g0/2", [(0, 12)]), joined, pub(6.5, 1)]
    assert check_trace(trace, k=0, allow_version_mixing=False).ok
    page = timeline_html(trace)
    ticks = re.findall(r'<line class="joined" x1="([\d.]+)"', page)
    end = 6.5  # the trace's last event; the plot spans x = 90 .. 990
    assert [float(x) for x in ticks] == [round(90 + t / end * 900, 1) for t in (4.0, 5.0)]
    assert 'class="joined"' not in timeline_html(clean_trace())


def test_a_span_with_no_tokens_does_not_make_a_trajectory_version_mixed() -> None:
    """An update that interrupts a request before its first token leaves an empty span on the old version: the
    trajectory's tokens all come from the new one. The audit and the runtime's count of mixed trajectories (summary's
    ``mixed_trajectories``) use this one rule; the runtime counted every trajectory of several spans."""
    from planner.schedule.checker import mixes_versions

    assert not mixes_versions([(1, 0), (2, 5)])
    assert not mixes_versions([(1, 0), (2, 0)]) and not mixes_versions([(3, 7)]) and not mixes_versions([])
    assert mixes_versions([(1, 3), (2, 5)]) and mixes_versions([(1, 0), (2, 4), (3, 1)])
