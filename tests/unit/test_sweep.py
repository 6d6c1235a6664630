"""`dora plan SPEC --sweep FIELD=V1,V2`: the spec planned once per value, each plan the one `dora plan` makes of the
spec with that value written in; bad sweeps and refused values said plainly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO
from test_search import SMALL_GPU  # the small GPU spec the search tests plan

from dora.cli import main
from dora.spec import SpecError, load_spec, load_spec_text
from dora.sweep import MAX_POINTS, Point, SweepError, best_index, parse_sweep, sweep_points

TINY = REPO / "specs" / "local-tiny.yaml"


def test_values_read_as_the_spec_file_reads_them_and_ranges_expand() -> None:
    s = parse_sweep("cluster.nodes=1, 2,4")
    assert (s.path, s.values) == (("cluster", "nodes"), (1, 2, 4))
    assert parse_sweep("staleness.max_version_lag=0..3").values == (0, 1, 2, 3)
    mixed = parse_sweep("x.y=true,1.5e-6,h100,2")
    assert mixed.values == (True, 1.5e-6, "h100", 2)
    assert [type(v) for v in mixed.values] == [bool, float, str, int]
    assert parse_sweep("a=1,true").values == (1, True)  # equal in Python, not the same value to the spec


@pytest.mark.parametrize(("arg", "message"), [
    ("cluster.nodes", "no values"),
    ("=1,2", "no field"),
    ("cluster.nodes=1,,2", "an empty value"),
    ("cluster..nodes=1", "not a spec field's dotted path"),
    ("cluster.nodes=4,4", "4 is given twice"),
    ("cluster.nodes=3..1", "must run upwards"),
    (f"cluster.nodes=1..{MAX_POINTS + 1}", f"at most {MAX_POINTS} integers"),
    ("cluster.nodes=[1", "not a single value"),
    ("cluster.nodes={a: 1}", "not a single value"),
])
def test_a_sweep_that_does_not_read_says_how_to_write_it(arg: str, message: str) -> None:
    with pytest.raises(SweepError, match=message) as caught:
        parse_sweep(arg)
    assert str(caught.value).startswith(f"--sweep {arg!r}: ")


def test_points_are_the_grid_of_the_sweeps_first_slowest() -> None:
    points = sweep_points([parse_sweep("a.b=1,2"), parse_sweep("c=x,y,z")])
    assert points == [((("a", "b"), 1), (("c",), v)) for v in "xyz"] + [((("a", "b"), 2), (("c",), v)) for v in "xyz"]
    with pytest.raises(SweepError, match="set the same field"):
        sweep_points([parse_sweep("placement.rollout=1"), parse_sweep("placement.rollout.tp=1,2")])
    with pytest.raises(SweepError, match=f"6 x 6 = 36 points, over the {MAX_POINTS}"):
        sweep_points([parse_sweep("a=1..6"), parse_sweep("b=1..6")])


def test_settings_replace_fields_of_the_file_and_keep_its_lines(tmp_path: Path) -> None:
    text = TINY.read_text()
    spec = tmp_path / "tiny.yaml"
    spec.write_text(text)
    swept = load_spec(str(spec), [(("workload", "prompts_per_step"), 8), (("staleness", "max_version_lag"), 2)])
    written = load_spec_text(text.replace("prompts_per_step: 16", "prompts_per_step: 8").replace(
        "max_version_lag: 3", "max_version_lag: 2"), str(spec), tmp_path)
    assert swept.spec_hash == written.spec_hash and swept.file == str(spec)
    # a mapping is made where the path has none, or a scalar ('placement: auto')
    auto = tmp_path / "auto.yaml"
    auto.write_text(re.sub(r"\nplacement:.*?\nruntime:", "\nplacement: auto\nruntime:", text, flags=re.S))
    assert load_spec(str(auto)).spec.placement == "auto"
    assert load_spec(str(auto), [(("placement", "colocated"), True)]).spec.placement.colocated is True
    with pytest.raises(SpecError) as caught:
        load_spec(str(spec), [(("cluster", "nodes"), 0)])
    (d,) = caught.value.diagnostics
    assert d.path == ("cluster", "nodes") and d.line == text.splitlines().index("  nodes: 1") + 1


def test_each_point_is_the_plan_of_the_spec_with_its_values_written_in(tmp_path: Path, capsys) -> None:
    assert main(["plan", str(TINY), "--json", "--sweep", "workload.prompts_per_step=8,32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"] == "throughput" and [p["settings"] for p in out["points"]] == [
        {"workload.prompts_per_step": 8}, {"workload.prompts_per_step": 32}]
    for point in out["points"]:
        n = point["settings"]["workload.prompts_per_step"]
        copy = tmp_path / f"tiny-{n}.yaml"
        copy.write_text(TINY.read_text().replace("prompts_per_step: 16", f"prompts_per_step: {n}"))
        assert main(["plan", str(copy), "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert point["plan"]["spec_hash"] == alone["spec_hash"]
        assert point["plan"]["predictions"] == alone["predictions"] and point["plan"]["rollout"] == alone["rollout"]
    rates = [p["plan"]["predictions"]["trained_tokens_per_s"] for p in out["points"]]
    assert out["best"] == rates.index(max(rates))


def test_the_table_marks_the_best_and_a_refused_value_says_why_beside_the_others(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no folded cells
    code = main(["plan", str(TINY), "--sweep", "workload.prompts_per_step=0,8,16"])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err
    assert "planning 3/3: workload.prompts_per_step=16" in captured.err
    out = " ".join(captured.out.split())
    assert "3 plans over workload.prompts_per_step" in out and "prompts_per_step" in out
    assert "invalid: workload.prompts_per_step (line" in out and "must be > 0, got 0" in out
    assert out.count("✔") == 1 and "best: the most trained tokens/s" in out
    assert "accel.-h: accelerator-hours for them (a point has no cluster.price_per_accelerator_hour_usd)" in out


def test_a_sweep_the_spec_refuses_for_every_value_exits_2_naming_the_field(capsys) -> None:
    assert main(["plan", str(TINY), "--sweep", "cluster.node=1,2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the spec refuses every value; the first, cluster.node=1: cluster.node (line" in err
    assert "did you mean 'nodes'?" in err and "Traceback" not in err


@pytest.mark.parametrize("flags", [["--out", "x"], ["--against", "x.json"]])
def test_a_sweep_is_refused_beside_flags_that_take_one_plan(flags: list[str], capsys) -> None:
    assert main(["plan", str(TINY), "--sweep", "cluster.nodes=1", *flags]) == 2
    assert "takes one plan" in capsys.readouterr().err
    assert main(["plan", str(TINY), "--sweep", "cluster.nodes"]) == 2
    assert "no values: write it as FIELD=V1,V2" in capsys.readouterr().err


def test_best_follows_the_specs_objective() -> None:
    from types import SimpleNamespace as NS

    def point(tps: float, total: float, hours: float, cost: float | None) -> Point:
        predictions = NS(trained_tokens_per_s=tps, total_time_s=total, accelerator_hours=hours, cost_usd=cost)
        return Point(settings=(), plan=NS(predictions=predictions), accelerators=8)

    points = [point(100, 50, 10, 30.0), point(90, 40, 8, 20.0), point(120, 45, 12, 10.0), Point(settings=(),
                                                                                              invalid="x")]
    assert best_index(points, "throughput") == 2
    assert best_index(points, "time") == 1
    assert best_index(points, "cost") == 2
    unpriced = [point(100, 50, 10, None), point(90, 40, 8, None)]
    assert best_index(unpriced, "cost") == 1  # accelerator-hours, what a price would multiply
    assert best_index([Point(settings=(), infeasible="x")], "throughput") is None


def test_a_priced_sweep_shows_the_cost_at_the_specs_price(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    spec = tmp_path / "small.yaml"  # test_search's small GPU spec, priced, ranked by cost
    spec.write_text(SMALL_GPU.replace("accelerators_per_node: 8}", "accelerators_per_node: 8, "
                                      "price_per_accelerator_hour_usd: 3.0}") + "objective: cost\n")
    assert main(["plan", str(spec), "--json", "--sweep", "cluster.price_per_accelerator_hour_usd=3.0,1.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    costs = [p["plan"]["predictions"]["cost_usd"] for p in out["points"]]
    assert costs[1] == pytest.approx(costs[0] / 2, rel=0.01) and out["best"] == 1  # the same plan at half the price
    assert main(["plan", str(spec), "--sweep", "cluster.price_per_accelerator_hour_usd=3.0,1.5"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "best: the lowest cost, the spec's objective (cost)" in text and f"${costs[1]:,.0f}" in text
    assert "cost: at the spec's cluster.price_per_accelerator_hour_usd, whatever the accelerator" in text


def test_a_point_that_changes_the_rollout_engine_plans_with_that_engines_catalog_entry(capsys, monkeypatch) -> None:
    """On `cpu` the catalog's constants depend on the rollout engine (``catalog_calibration``): each point is planned
    with its own engine's, as `dora plan` of a copy with that engine would. The table's "vs sync" is over the best sync
    plan, as its legend says, starred where the spec's pins rule that plan out (it showed the pinned sync's)."""
    from planner.calibration import DEFAULT_CALIBRATION, VLLM_CPU_CALIBRATION

    spec = REPO / "specs" / "local-tiny-vllm.yaml"
    assert main(["plan", str(spec), "--json", "--sweep", "runtime.rollout_engine=torch,vllm"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    torch, vllm = (p["plan"] for p in points)
    assert torch["calibration_fingerprint"] == DEFAULT_CALIBRATION.fingerprint()
    assert vllm["calibration_fingerprint"] == VLLM_CPU_CALIBRATION.fingerprint()
    assert main(["plan", str(spec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predictions"] == vllm["predictions"]
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plan", str(spec), "--sweep", "runtime.rollout_engine=torch,vllm"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    starred = [p for p in (torch, vllm) if p["predictions"]["speedup_vs_sync_any_placement"] is not None]
    assert starred  # the spec pins a disaggregated placement; the best sync plan of its 2 cores is colocated
    for plan in (torch, vllm):
        p = plan["predictions"]
        shown = (f"{p['speedup_vs_sync']:.2f}x " if p["speedup_vs_sync_any_placement"] is None
                 else f"{p['speedup_vs_sync_any_placement']:.2f}x* ")
        assert shown in out
    assert "(*: on a placement the spec's pins rule out" in out
