import json

import pytest

from planner.schedule import (
    TraceError,
    build_schedule_graph,
    check_trace,
    graph_to_dot,
    graph_to_json,
    parse_trace,
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
    trace = [adm(0, "g0/0", 0), fin(2, "g0/0", [(0, 3), (1, 4)]), step(3, 2, ["g0/0"])]
    rep = check_trace(trace, k=1, allow_version_mixing=False)
    (v,) = rep.of("consistency")
    assert v.traj == "g0/0" and v.versions == (0, 1) and "mixes versions [0, 1]" in v.message
    lenient = check_trace(trace, k=1, allow_version_mixing=True)
    assert lenient.ok and lenient.mixed == ("g0/0",)


def test_staleness_uses_oldest_span_and_reports_step():
    trace = [adm(0, "g0/0", 0), fin(2, "g0/0", [(0, 3), (2, 4)]), step(3, 3, ["g0/0"])]
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
    ghost = check_trace([step(2, 1, ["g9/9"])], k=0, allow_version_mixing=False)
    assert "never admitted" in ghost.of("integrity")[0].message
    discarded = base + [step(2, 1, ["g0/0"]), {"t": 2, "type": "discarded", "traj": "g0/1", "reason": "bad reward"}]
    rep = check_trace(discarded, k=0, allow_version_mixing=False)
    assert rep.ok and rep.discarded == ("g0/1",)


def test_regenerated_trajectory_restarts_its_spans():
    trace = [adm(0, "g0/0", 0), {"t": 1, "type": "regenerated", "traj": "g0/0", "version": 1},
             adm(1, "g0/0", 1), fin(2, "g0/0", [(1, 5)]), step(3, 2, ["g0/0"])]
    assert check_trace(trace, k=0, allow_version_mixing=False).ok


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
    data = json.loads(graph_to_json(g))
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
