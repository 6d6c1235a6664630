"""`dora plan` / `dora diff` end to end: golden plan files, the plan directory, exit codes, no tracebacks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from conftest import REPO

from dora.cli import main

GOLDEN = REPO / "tests" / "golden" / "plans"
SPECS = REPO / "specs"
GOLDEN_SPECS = ["local-tiny", "dense-8b-h800x64", "dense-32b-h800x128"]


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dora.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.mark.parametrize("stem", GOLDEN_SPECS)
def test_plan_json_golden(stem: str, update_golden: bool, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import assert_golden

    monkeypatch.chdir(REPO)
    assert main(["plan", f"specs/{stem}.yaml", "--json"]) == 0
    out = capsys.readouterr().out
    json.loads(out)
    assert_golden(GOLDEN / f"{stem}.plan.json", out, update_golden)


def test_plan_dir_and_detailed_exitcode(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    proc = _run("plan", "specs/local-tiny.yaml", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    for name in ("plan.json", "report.txt", "timeline.html", "schedule.json", "schedule.dot", "launch/runtime.json",
                 "launch/launch.sh"):
        assert (out / name).is_file(), name
    assert "<svg" in (out / "timeline.html").read_text()
    again = tmp_path / "again"
    assert _run("plan", "specs/local-tiny.yaml", "--out", str(again)).returncode == 0
    assert (again / "plan.json").read_bytes() == (out / "plan.json").read_bytes()

    same = _run("plan", "specs/local-tiny.yaml", "--against", str(out / "plan.json"), "--detailed-exitcode")
    assert same.returncode == 0 and "No changes" in same.stdout
    changed_spec = tmp_path / "changed.yaml"
    changed_spec.write_text((SPECS / "local-tiny.yaml").read_text().replace("steps: 150", "steps: 75"))
    changed = _run("plan", str(changed_spec), "--against", str(out / "plan.json"), "--detailed-exitcode")
    assert changed.returncode == 2, changed.stderr
    assert "~ predictions.total_time_s" in changed.stdout and "to change" in changed.stdout
    assert "Inputs (spec):\n  ~ workload.steps: 150 -> 75" in changed.stdout  # the plan records its inputs
    broken = _run("plan", "specs/local-tiny.yaml", "--against", str(tmp_path / "nope.json"), "--detailed-exitcode")
    assert broken.returncode == 1 and "does not exist" in broken.stderr


def test_diff_two_specs(tmp_path: Path) -> None:
    bigger = tmp_path / "bigger.yaml"
    bigger.write_text((SPECS / "local-tiny.yaml").read_text().replace("steps: 150", "steps: 300"))
    proc = _run("diff", "specs/local-tiny.yaml", str(bigger), "--detailed-exitcode")
    assert proc.returncode == 2, proc.stderr
    assert "Plan: 0 to add" in proc.stdout


def test_infeasible_plan_exits_nonzero_without_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "huge.yaml"
    spec.write_text((SPECS / "moe-235b-h800x512.yaml").read_text().replace("nodes: 64", "nodes: 1").replace(
        "accelerator: h800", "accelerator: a100-80g"))
    proc = _run("plan", str(spec))
    assert proc.returncode == 1
    assert "nothing fits" in proc.stderr and "closest candidate" in proc.stderr
    assert "Traceback" not in proc.stderr and "pinned" not in proc.stderr
    spec.write_text(spec.read_text() + "placement:\n  train: {tp: 2}\n")
    pinned = _run("plan", str(spec))
    assert pinned.returncode == 1 and "to fix: remove or relax the pinned sizes under placement" in pinned.stderr


def test_against_a_spec_says_it_is_a_spec() -> None:
    """It said "not readable JSON: Expecting value: line 1 column 1"."""
    proc = _run("plan", "specs/local-tiny.yaml", "--against", "specs/local-tiny.yaml")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "'specs/local-tiny.yaml' is a spec, not a plan: give a plan.json" in " ".join(proc.stderr.split())


def test_bad_plan_file_format_version(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"format_version": 99}))
    proc = _run("plan", "specs/local-tiny.yaml", "--against", str(bad))
    assert proc.returncode == 2 and "format_version 99" in proc.stderr


def test_report_gives_the_overlap_ceiling_against_the_best_sync_plan() -> None:
    import re

    from dora.report import plan_report_text
    from planner.plan import Plan

    plan = Plan.from_dict(json.loads((GOLDEN / "dense-32b-h800x128.plan.json").read_text()))
    p = plan.predictions
    text = " ".join(plan_report_text(plan, width=200).split())
    found = re.search(r"overlap ceiling ([\d.]+K) trained tokens/s \(([\d.]+)x best sync\); this plan reaches (\d+)%",
                      text)
    assert found, text
    assert found.group(2) == f"{p.speedup_vs_sync * p.overlap_ceiling_tokens_per_s / p.trained_tokens_per_s:.2f}"
    assert float(found.group(2)) > p.speedup_vs_sync  # the ceiling bounds the plan
    assert found.group(3) == f"{100 * p.trained_tokens_per_s / p.overlap_ceiling_tokens_per_s:.0f}"


def test_report_gives_both_sync_baselines_of_a_pinned_placement() -> None:
    """The ceiling's multiple is over the best sync plan too, the one on any placement where the spec pins one."""
    import re

    from dora.report import plan_report_text
    from planner.plan import Plan

    plan = Plan.from_dict(json.loads((GOLDEN / "local-tiny.plan.json").read_text()))
    p = plan.predictions
    assert p.speedup_vs_sync_any_placement is not None
    text = " ".join(plan_report_text(plan, width=200).split())
    assert (f"speedup vs best sync plan {p.speedup_vs_sync_any_placement:.2f}x, over sync on a placement the spec's "
            f"pins rule out (see the considered plans); {p.speedup_vs_sync:.2f}x over sync on the pinned one") in text
    found = re.search(r"\(([\d.]+)x best sync\)", text)
    ceiling = p.speedup_vs_sync_any_placement * p.overlap_ceiling_tokens_per_s / p.trained_tokens_per_s
    assert found and found.group(1) == f"{ceiling:.2f}"
    unpinned = Plan.from_dict(json.loads((GOLDEN / "dense-32b-h800x128.plan.json").read_text()))
    assert unpinned.predictions.speedup_vs_sync_any_placement is None
    assert "pinned" not in " ".join(plan_report_text(unpinned, width=200).split()).split("overlap ceiling")[0]


def test_report_gives_a_colocated_plans_host_memory_moves() -> None:
    """Colocated streaming moves every engine's weights and KV cache to host memory and back around each step, and
    the trainer's state the other way: the report says how long, and a plan on separate accelerators has neither."""
    import re

    from dora.planning import make_plan
    from dora.report import plan_report_text
    from dora.spec import load_spec_text
    from planner.hardware import get_accelerator
    from planner.plan import Plan
    from planner.weight_sync import host_swap_s

    # the dense-32B example's best colocated plan (its chosen plan is disaggregated)
    text = (SPECS / "dense-32b-h800x128.yaml").read_text() + "placement:\n  colocated: true\n"
    plan = make_plan(load_spec_text(text, "dense-32b-colocated.yaml", SPECS)).plan
    assert plan.colocated and plan.mode == "streaming"
    p = plan.predictions
    text = " ".join(plan_report_text(plan, width=200).split())
    found = re.search(r"host memory moves per step (\S+ \S+): engines out and back (\S+ \S+), trainer state out and "
                      r"back (\S+ \S+)", text)
    assert found, text
    # to the precision at which the printed parts add up to the printed total (4.5 s + 1.1 s printed as 5.5 s once)
    shown = [Decimal(found.group(i).split()[0]) for i in (1, 2, 3)]
    assert shown[0] == shown[1] + shown[2]
    for printed, exact in zip(shown, (p.engine_swap_s + p.trainer_swap_s, p.engine_swap_s, p.trainer_swap_s),
                              strict=True):
        assert abs(float(printed) - exact) <= 0.5 * 10.0 ** printed.as_tuple().exponent + 1e-9
    # the slowest engine's move, out and back, not the sum over the 32 engines: at least its weights one way, at most
    # its weights and whole KV cache both ways, after a weight load it may have had to finish first
    rollout = next(m for m in plan.memory if m.side == "rollout")
    h800 = get_accelerator("h800")
    least = host_swap_s(h800, bytes_per_device=rollout.detail["weights"])
    most = 2 * host_swap_s(h800, bytes_per_device=rollout.detail["weights"] + rollout.detail["kv_cache"])
    assert least < p.engine_swap_s <= most + p.weight_sync_s
    assert p.trainer_swap_s > 0
    # colocated sync moves only the trainer's state (its engines are reloaded from the trainer: weight sync)
    import dataclasses

    sync = dataclasses.replace(plan, mode="sync", predictions=dataclasses.replace(p, engine_swap_s=0.0))
    row = next(line for line in plan_report_text(sync, width=200).splitlines() if "host memory moves" in line)
    assert "engines" not in row and f"trainer state out and back {p.trainer_swap_s:.1f} s" in row
    apart = Plan.from_dict(json.loads((GOLDEN / "dense-32b-h800x128.plan.json").read_text()))
    assert not apart.colocated
    assert apart.predictions.engine_swap_s == apart.predictions.trainer_swap_s == 0.0
    assert "host memory moves" not in plan_report_text(apart, width=200)


def test_report_gives_the_kv_cache_recomputes_per_step() -> None:
    """A plan says how many sequences per step restart without their KV cache (preempted when an engine's cache filled,
    as vLLM does, or migrated to an engine without room) and what they re-prefill; a plan whose contexts always fit
    says none."""
    from dora.report import plan_report_text
    from planner.plan import Plan

    plan = Plan.from_dict(json.loads((GOLDEN / "dense-32b-h800x128.plan.json").read_text()))
    p = plan.predictions
    assert 0 < p.kv_preemptions_per_step < p.kv_recomputes_per_step  # streaming migrates some where they do not fit
    # a restart re-prefills its prompt and the tokens it had: at most a whole context each
    assert 0 < p.kv_recomputed_tokens_per_step <= p.kv_recomputes_per_step * plan.rollout.max_model_len
    row = next(line for line in plan_report_text(plan, width=200).splitlines() if "KV-cache recomputes" in line)
    migrated = p.kv_recomputes_per_step - p.kv_preemptions_per_step
    found = re.search(r"([\d.]+) sequences \(([\d.]+) preempted when an engine's cache filled, ([\d.]+) migrated "
                      r"to an engine without room\), re-prefilling ", row)
    assert found is not None, row
    total, preempted, moved = (Decimal(x) for x in found.groups())
    assert total == preempted + moved  # the printed parts add up to the printed total
    for shown, exact in ((total, p.kv_recomputes_per_step), (preempted, p.kv_preemptions_per_step), (moved, migrated)):
        assert abs(float(shown) - exact) <= 0.5 * 10.0 ** shown.as_tuple().exponent + 1e-9
    tiny = Plan.from_dict(json.loads((GOLDEN / "local-tiny.plan.json").read_text()))
    t = tiny.predictions
    assert t.kv_preemptions_per_step == t.kv_recomputes_per_step == t.kv_recomputed_tokens_per_step == 0
    row = next(line for line in plan_report_text(tiny, width=200).splitlines() if "KV-cache recomputes" in line)
    assert "none" in row


def test_report_holds_a_colocated_plan_to_the_same_ceiling() -> None:
    # The ceiling is over every placement, colocated ones included (rollout and training in turn), so it bounds a
    # colocated plan too; it once covered the disaggregated placements only and a colocated plan could read "122%".
    import re

    from dora.planning import make_plan
    from dora.report import plan_report_text
    from dora.spec import load_spec_text

    text = re.sub(r"^  colocated: \w+\n", "", (REPO / "specs" / "local-tiny.yaml").read_text(), flags=re.M)
    text = text.replace("placement:\n", "placement:\n  colocated: true\n")
    assert "colocated: true" in text
    plan = make_plan(load_spec_text(text, "colocated.yaml", REPO / "specs")).plan
    assert plan.colocated
    report = " ".join(plan_report_text(plan, width=200).split())
    found = re.search(r"overlap ceiling \S+ trained tokens/s \([\d.]+x best sync\); this plan reaches (\d+)%", report)
    assert found, report
    p = plan.predictions
    assert found.group(1) == f"{100 * p.trained_tokens_per_s / p.overlap_ceiling_tokens_per_s:.0f}"
    assert 0 < p.trained_tokens_per_s <= p.overlap_ceiling_tokens_per_s


def test_a_plan_at_the_ceiling_reads_as_at_it_not_past_it() -> None:
    """dense-8b with 16-token answers is bound by its trainer, whose step time is that of the mean batch, and trains
    the simulated batches' drawn tokens: a few ppm over the ceiling, which the report printed as "reaches >100%"."""
    from dora.planning import make_plan
    from dora.report import CEILING_SAMPLING, plan_report_text
    from dora.spec import load_spec_text

    text = (REPO / "specs" / "dense-8b-h800x64.yaml").read_text()
    text, n = re.subn(r"response_length: \{[^}]*\}", "response_length: {median_tokens: 16, p99_tokens: 16, "
                      "max_tokens: 16}", text)
    assert n == 1
    plan = make_plan(load_spec_text(text, "short.yaml", REPO / "specs")).plan
    p = plan.predictions
    assert p.overlap_ceiling_tokens_per_s is not None
    fraction = p.trained_tokens_per_s / p.overlap_ceiling_tokens_per_s
    assert 1 < fraction <= 1 + CEILING_SAMPLING
    report = " ".join(plan_report_text(plan, width=200).split())
    assert "this plan is at it" in report and ">100%" not in report, report


def test_the_sync_baseline_row_says_when_a_pinned_placement_holds_it_too() -> None:
    """local-tiny pins the disaggregated placement, which holds the speedup's sync baseline to disaggregated sync
    (one training core): the row read as if it were the best sync plan of the whole cluster."""
    from dora.planning import make_plan
    from dora.spec import load_spec

    plan = make_plan(load_spec(str(REPO / "specs" / "local-tiny.yaml"))).plan
    base = [c for c in plan.considered if c.reason.startswith("the sync baseline of the speedup figure")]
    assert len(base) == 1 and not base[0].colocated
    assert base[0].reason.startswith("the sync baseline of the speedup figure (the spec pins streaming and a "
                                     "disaggregated placement;")


def test_plan_out_names_a_directory_it_cannot_write(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = _run("plan", "specs/local-tiny.yaml", "--out", str(blocker / "plan"))
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write the plan to {blocker / 'plan'}/" in proc.stderr and "--out" in proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


def test_a_plan_file_is_checked_and_diffed_field_by_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    golden = GOLDEN / "local-tiny.plan.json"
    plan = json.loads(golden.read_text())
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(plan | {"objective": "zz"}))
    assert main(["diff", str(golden), str(tampered), "--detailed-exitcode"]) == 1
    err = capsys.readouterr().err
    assert "objective" in err and "'zz' is not one of 'throughput', 'cost', 'time'" in err
    other = tmp_path / "other.json"
    other.write_text(json.dumps(plan | {"objective": "cost", "spec_name": "renamed"}))
    assert main(["diff", str(golden), str(other), "--detailed-exitcode"]) == 2
    out = capsys.readouterr().out
    assert "~ objective: 'throughput' -> 'cost'" in out and "~ spec_name: 'local-tiny' -> 'renamed'" in out


def test_the_runtime_config_is_not_taken_for_an_old_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime = tmp_path / "runtime.json"
    runtime.write_text(json.dumps({"format_version": 3, "rollout_workers": 1, "mode": "sync"}))
    assert main(["diff", str(GOLDEN / "local-tiny.plan.json"), str(runtime)]) == 2
    err = capsys.readouterr().err
    assert "is the runtime config" in err and "format_version" not in err


def test_format_rate_rolls_over_to_the_next_unit_after_rounding() -> None:
    from planner.plan import format_rate

    assert format_rate(999_999) == "1.00M" and format_rate(999.96) == "1.00K"  # were '1000.00K' and '1000.0'
    assert (format_rate(999.94), format_rate(12345.6), format_rate(2.5e6), format_rate(512)) == (
        "999.9", "12.35K", "2.50M", "512.0")
    assert format_rate(0.04) == "<0.1" and format_rate(0) == "0.0"
    assert (format_rate(float("nan")), format_rate(float("inf"))) == ("nan", "inf")  # were 'nanM' and 'infM'


def test_report_rounding_never_misleads() -> None:
    """A non-zero part printed as 0.0, parts that do not add up to the printed total, 0%/100% for 0.4%/99.94%, and
    '0.0 sequences (0.0 preempted' for 0.04 (the reviewer's render_rounding.py)."""
    import dataclasses
    import re

    from dora.report import _dur, plan_report_text
    from planner.plan import Plan

    tiny = Plan.from_dict(json.loads((GOLDEN / "local-tiny.plan.json").read_text()))
    plan = dataclasses.replace(tiny, predictions=dataclasses.replace(
        tiny.predictions, bubble_fraction=0.004, rollout_occupancy=0.99943, trainer_utilization=1.0,
        kv_recomputes_per_step=0.04, kv_preemptions_per_step=0.04, kv_recomputed_tokens_per_step=3.0))
    text = plan_report_text(plan, width=200)
    row = {line.split("  ")[0].strip(): " ".join(line.split()) for line in text.splitlines()}
    assert row["bubble fraction"].endswith("fraction <1%")
    assert row["rollout slot occupancy"].endswith("occupancy >99%")
    assert row["trainer utilization"].endswith("utilization 100%")  # exactly 1
    assert "<0.1 sequences (<0.1 preempted when an engine's cache filled), re-prefilling 3.0 tokens" in text
    for golden in ("local-tiny", "dense-32b-h800x128", "dense-8b-h800x64"):
        report = plan_report_text(Plan.from_dict(json.loads((GOLDEN / f"{golden}.plan.json").read_text())), width=200)
        rows = [line for line in report.splitlines() if re.match(r"│ (rollout|train) +│ [\d.]+ GiB +│", line)]
        assert len(rows) == 2, report
        for line in rows:
            _, side, uses, _, _, breakdown, _ = line.split("│")
            parts = dict(p.split() for p in breakdown.strip().removesuffix(" (GiB)").split(", "))
            assert all(float(v.lstrip("<")) > 0 for v in parts.values()), line  # no part printed as 0.0
            numeric = [float(v) for v in parts.values() if not v.startswith("<")]
            decimals = len(uses.split()[0].split(".")[1])
            assert round(sum(numeric), decimals) == float(uses.split()[0]), line  # the parts add up to the total
    tiny_rows = plan_report_text(tiny, width=200)
    assert "extra_versions <0.01, kv_cache 0.01, reserved 0.25, weights <0.01 (GiB)" in tiny_rows
    assert "│ 0.26 GiB │" in tiny_rows
    assert (_dur(0.9996), _dur(119.97), _dur(0.0001), _dur(0.25)) == ("1.0 s", "2.0 min", "<1 ms", "250 ms")
    # a total in minutes and parts in seconds never add up to the digit: the fewest decimals, not '100.000 s'
    from types import SimpleNamespace

    from dora.report import _host_moves

    assert _host_moves(SimpleNamespace(engine_swap_s=100.0, trainer_swap_s=25.0)) == (
        "2.1 min: engines out and back 100.0 s, trainer state out and back 25.0 s")


def _project(root: Path, name: str, seed: int = 0) -> Path:
    """A project directory planned as `dora plan specs/local-tiny.yaml --out plans/x` (the golden plan), its spec's
    runtime.seed set to ``seed`` (0: the spec the plan was made from)."""
    (root / name / "specs").mkdir(parents=True)
    (root / name / "specs" / "local-tiny.yaml").write_text(
        (SPECS / "local-tiny.yaml").read_text().replace("seed: 0", f"seed: {seed}"))
    (root / name / "plans" / "x").mkdir(parents=True)
    (root / name / "plans" / "x" / "plan.json").write_text((GOLDEN / "local-tiny.plan.json").read_text())
    return root / name


def test_a_saved_plan_applied_from_another_project_checks_its_own_spec(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's spec_file is relative to where `dora plan` ran; a same-named spec in the working directory was
    read first, so project A's plan applied from project B was checked against B's spec and refused as stale, with
    advice to overwrite A's plan from B's spec."""
    from dora.apply import ApplyInputError, plan_for_apply

    assert "seed: 0" in (SPECS / "local-tiny.yaml").read_text()
    a, b = _project(tmp_path, "projA"), _project(tmp_path, "projB", seed=1)
    monkeypatch.chdir(b)
    resolved, plan = plan_for_apply("../projA/plans/x", None, None)
    assert resolved.file == "../projA/specs/local-tiny.yaml" and resolved.spec_hash == plan.spec_hash
    # a plan written into another project's tree, applied from where it was planned: the spec here is its own
    (a / "specs" / "local-tiny.yaml").write_text((a / "specs" / "local-tiny.yaml").read_text().replace(
        "seed: 0", "seed: 5"))
    (b / "specs" / "local-tiny.yaml").write_text((SPECS / "local-tiny.yaml").read_text())
    resolved, _ = plan_for_apply("../projA/plans/x", None, None)
    assert resolved.file == "specs/local-tiny.yaml"
    # neither matches: stale against the spec next to the plan, named as read in every part of the message
    (b / "specs" / "local-tiny.yaml").write_text((a / "specs" / "local-tiny.yaml").read_text())
    with pytest.raises(ApplyInputError) as stale:
        plan_for_apply("../projA/plans/x", None, None)
    message = str(stale.value)
    assert "but ../projA/specs/local-tiny.yaml now hashes to" in message
    assert "(`dora diff ../projA/plans/x/plan.json ../projA/specs/local-tiny.yaml` lists them all)" in message
    assert "run `dora plan ../projA/specs/local-tiny.yaml --out ../projA/plans/x` again" in message
    assert "`dora apply ../projA/specs/local-tiny.yaml` to plan and run" in message
    assert " specs/local-tiny.yaml" not in message


def test_a_saved_plan_in_a_symlinked_directory_checks_its_own_spec(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """projA/plans is a symlink to a store elsewhere: the parents of the resolved plan were searched, never
    projA's, so projB's same-named spec was read instead."""
    import shutil

    from dora.apply import plan_for_apply

    a, b = _project(tmp_path, "projA"), _project(tmp_path, "projB", seed=1)
    shutil.move(a / "plans", tmp_path / "store")
    (a / "plans").symlink_to(tmp_path / "store")
    monkeypatch.chdir(b)
    resolved, plan = plan_for_apply("../projA/plans/x", None, None)
    assert resolved.file == "../projA/specs/local-tiny.yaml" and resolved.spec_hash == plan.spec_hash


def test_stale_plan_advice_keeps_the_plans_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A plan made with --calibration FILE: the refusal's `dora plan`, `dora apply` and `dora diff` commands carry
    it (a diff without it re-plans on catalog defaults and reports every prediction changed)."""
    from dora.apply import ApplyInputError, plan_for_apply

    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "tiny.yaml").write_text((SPECS / "local-tiny.yaml").read_text())
    (tmp_path / "cal.json").write_text(json.dumps({"calibration": {"cpu_compute_efficiency": 0.3}}))
    assert main(["plan", "specs/tiny.yaml", "--calibration", "cal.json", "--out", "plans/c"]) == 0
    capsys.readouterr()
    assert main(["diff", "plans/c", "specs/tiny.yaml", "--calibration", "cal.json", "--detailed-exitcode"]) == 0
    assert "No changes." in capsys.readouterr().out
    assert main(["diff", "plans/c", "specs/tiny.yaml", "--detailed-exitcode"]) == 2  # planned on catalog defaults
    assert "~ calibration_source: 'file cal.json' -> 'catalog defaults'" in capsys.readouterr().out
    assert main(["diff", "plans/c", "plans/c", "--calibration", "cal.json"]) == 2  # nothing to plan with it
    assert "--calibration plans a spec side, but both sides are saved plans" in capsys.readouterr().err

    spec = tmp_path / "specs" / "tiny.yaml"
    spec.write_text(spec.read_text().replace("seed: 0", "seed: 3"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the calibration file too is named from here
    with pytest.raises(ApplyInputError) as stale:
        plan_for_apply("../plans/c", None, None)
    message = str(stale.value)
    assert "`dora diff ../plans/c/plan.json ../specs/tiny.yaml --calibration ../cal.json` lists them all" in message
    assert "run `dora plan ../specs/tiny.yaml --calibration ../cal.json --out ../plans/c` again" in message
    assert "`dora apply ../specs/tiny.yaml --calibration ../cal.json` to plan and run" in message
    # a calibration `dora calibrate` measured records its source, not its file's name
    saved = json.loads((tmp_path / "plans" / "c" / "plan.json").read_text())
    (tmp_path / "plans" / "c" / "plan.json").write_text(json.dumps(saved | {"calibration_source": "measured: x"}))
    with pytest.raises(ApplyInputError, match=r"`dora plan \.\./specs/tiny.yaml --calibration FILE --out \.\./plans/c`"
                                              r" \(FILE: the calibration file it was planned with, measured: x\)"):
        plan_for_apply("../plans/c", None, None)


def test_diff_of_a_spec_nothing_fits_says_so_like_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "huge.yaml"
    spec.write_text((SPECS / "moe-235b-h800x512.yaml").read_text().replace("nodes: 64", "nodes: 1").replace(
        "accelerator: h800", "accelerator: a100-80g"))
    for flags in ([], ["--detailed-exitcode"]):
        assert main(["diff", str(SPECS / "local-tiny.yaml"), str(spec), *flags]) == 1  # an error, as in `dora plan`
        err = capsys.readouterr().err
        assert f"{spec}: nothing fits — no placement fits" in err and "closest candidate" in err
        assert "to fix: add accelerators" in err and "Traceback" not in err
        assert err.count("does not fit: needs") == 1, err  # the closest candidate's detail, once (it was twice)


def test_nothing_fits_names_each_side_that_has_no_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dense 32B on one H800 named only the rollout's shortfall (16 slots needed, 7 held), the closest by ratio: the
    trainer's 617 GiB on an 80 GB accelerator stops it too, and it was never said."""
    spec = tmp_path / "one.yaml"
    spec.write_text((SPECS / "dense-32b-h800x128.yaml").read_text().replace("nodes: 16", "nodes: 1").replace(
        "accelerators_per_node: 8", "accelerators_per_node: 1"))
    assert main(["plan", str(spec)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "closest candidate: rollout tp1 it lacks: does not fit: a prompt group of 16 samples" in err, err
    assert "and on the other side: train on 1 it lacks: train 1 (tp=1 pp=1 dp=1 ep=1 cp=1): does not fit: needs" in err
    # one side fitting: only the other is named
    spec.write_text((SPECS / "dense-8b-h800x64.yaml").read_text().replace("nodes: 8", "nodes: 1").replace(
        "accelerators_per_node: 8", "accelerators_per_node: 1"))
    assert main(["plan", str(spec)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing fits" in err and "and on the other side" not in err


def test_a_cpu_engine_whose_preallocated_cache_does_not_fit_is_refused(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """dora's CPU engine preallocates every slot at the whole context: 40 slots of 200,004 tokens are 7.6 GiB of
    local-tiny's KV cache, over the 7.2 GiB of an 8 GiB core. The plan used to take it (the memory model was vLLM's
    page pool) and the run would have allocated it."""
    spec = tmp_path / "long.yaml"
    spec.write_text((SPECS / "local-tiny.yaml").read_text().replace("p99_tokens: 96, max_tokens: 128}",
                                                                     "p99_tokens: 96, max_tokens: 200000}"))
    assert main(["plan", str(spec)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing fits" in err and "the engine preallocates 40 slots of 200004 tokens (7.6 GiB of KV cache)" in err
    assert "lower placement.rollout.max_num_seqs or the lengths" in err and "placement.rollout.max_num_seqs = 40" in err


def test_an_absurd_architecture_prints_its_needs_in_powers_of_ten(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Every size at config.json's bound, 2**40: the closest candidate needed
    541598769781708730610483200.0 GiB per device."""
    big = 2**40
    spec = tmp_path / "absurd.yaml"
    spec.write_text(re.sub(r"  preset: .*\n", f"  architecture: {{num_layers: {big}, hidden_size: {big}, "
                           f"num_attention_heads: {big}, head_dim: 128, ffn_hidden_size: {big}, vocab_size: {big}}}\n",
                           (SPECS / "dense-8b-h800x64.yaml").read_text()))
    assert main(["plan", str(spec)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing fits" in err and re.search(r"needs \d\.\d\de\+\d+ GiB per device \(weights \d\.\d\de\+\d+ ", err), err
    assert not re.search(r"\d{8}", err), err


def test_pins_nothing_fits_are_named_with_their_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'nothing fits' named the closest candidate, but not the placement fields the spec pinned."""
    spec = tmp_path / "pinned.yaml"
    spec.write_text((SPECS / "moe-235b-h800x512.yaml").read_text().replace("nodes: 64", "nodes: 1").replace(
        "accelerator: h800", "accelerator: a100-80g") + "placement:\n  colocated: true\n  train:\n    tp: 2\n")
    at = {text.strip(): i + 1 for i, text in enumerate(spec.read_text().splitlines())}
    assert main(["plan", str(spec)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"{spec}: nothing fits" in err and "Traceback" not in err
    assert (f"the spec pins: placement.colocated = true (line {at['colocated: true']}), "
            f"placement.train.tp = 2 (line {at['tp: 2']})") in err
    assert "to fix: remove or relax the pinned sizes under placement" in err


def test_a_pinned_training_size_no_layout_takes_is_invalid_in_validate_and_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """63 of 64 accelerators for training: no tp x pp x cp x dp of 63 has a dp dividing the batch. `dora validate` said
    ok, and `dora plan` only "nothing fits", naming neither the field nor its line."""
    spec = tmp_path / "pinned.yaml"
    spec.write_text((SPECS / "dense-8b-h800x64.yaml").read_text().replace(
        "\nruntime:", "\nplacement:\n  colocated: false\n  rollout:\n    accelerators: 1\n  train:\n"
                      "    accelerators: 63\nruntime:"))
    line = 1 + spec.read_text().splitlines().index("    accelerators: 63")
    for command in ("validate", "plan"):
        assert main([command, str(spec)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert (f"placement.train.accelerators (line {line}): no training layout takes 63 accelerators: none of tp x "
                "pp x cp x dp = 63 has tp dividing the heads") in err, err
        assert "to fix: train on 48 or 52 or 56 accelerators instead" in err and "Traceback" not in err
    spec.write_text(spec.read_text().replace("accelerators: 63", "accelerators: 56"))
    assert main(["validate", str(spec)]) == 0


def test_a_new_dora_version_alone_is_no_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    golden = GOLDEN / "local-tiny.plan.json"
    other = tmp_path / "plan.json"
    other.write_text(json.dumps(json.loads(golden.read_text()) | {"dora_version": "99.0"}))
    assert main(["diff", str(golden), str(other), "--detailed-exitcode"]) == 0
    out = capsys.readouterr().out
    assert "Context (not a change):\n  ~ dora_version: " in out and "-> '99.0'" in out and "No changes." in out


def test_memory_entries_are_compared_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    golden = GOLDEN / "local-tiny.plan.json"
    plan = json.loads(golden.read_text())
    reordered, emptied = tmp_path / "reordered.json", tmp_path / "emptied.json"
    reordered.write_text(json.dumps(plan | {"memory": plan["memory"][::-1]}))
    emptied.write_text(json.dumps(plan | {"memory": []}))
    assert main(["diff", str(golden), str(reordered), "--detailed-exitcode"]) == 0
    assert "No changes." in capsys.readouterr().out
    assert main(["diff", str(golden), str(emptied), "--detailed-exitcode"]) == 2
    out = capsys.readouterr().out
    assert "+ memory" not in out and "memory[0]" not in out and "memory[rollout].side" not in out
    assert "  - memory[rollout].need_bytes: " in out and "  - memory[train].need_bytes: " in out
    assert "Plan: 0 to add, 0 to change, " in out
    # bytes print in GiB, as the report's memory table does (they printed as 9.96968e+09)
    need = plan["memory"][1]["need_bytes"]
    doubled = [m | {"need_bytes": 2 * m["need_bytes"]} if m["side"] == "train" else m for m in plan["memory"]]
    emptied.write_text(json.dumps(plan | {"memory": doubled}))
    assert main(["diff", str(golden), str(emptied)]) == 0
    out = capsys.readouterr().out
    assert f"  ~ memory[train].need_bytes: {need / 2**30:,.2f} GiB -> {2 * need / 2**30:,.2f} GiB  (+100.0%)" in out
    assert "e+0" not in out


def test_host_memory_rules_out_colocated_plans_and_names_its_field(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A colocated plan parks the trainer's state, or the engines' weights and KV cache, in host memory; a plan that
    does not fit it was chosen anyway (the 32B example's colocated streaming parks 69 GiB per accelerator)."""
    text = (SPECS / "dense-32b-h800x128.yaml").read_text()
    small = tmp_path / "small-host.yaml"
    small.write_text(text.replace("accelerators_per_node: 8", "accelerators_per_node: 8\n  host_memory_gib_per_node: 512"))
    assert main(["plan", str(small), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["colocated"] is False and not any(m["side"] == "host" for m in plan["memory"])
    # pinned colocated, with too little host memory for even sync's trainer state: nothing fits, said with the field
    tiny = tmp_path / "tiny-host.yaml"
    tiny.write_text(text.replace("accelerators_per_node: 8", "accelerators_per_node: 8\n  host_memory_gib_per_node: 200")
                    + "placement:\n  colocated: true\n")
    line = 1 + tiny.read_text().splitlines().index("  host_memory_gib_per_node: 200")
    assert main(["plan", str(tiny)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tiny}: nothing fits" in err and "Traceback" not in err
    assert ("it lacks: does not fit host memory: 37.0 GiB per accelerator (trainer_state 27.0, reserved 10.0 GiB) "
            "against its 25.0 GiB share of the node's 200 GiB over 8 accelerators") in err, err
    assert f"the spec sets: cluster.host_memory_gib_per_node = 200 (line {line})" in err


def test_a_warning_whose_figures_moved_is_one_change_in_a_diff() -> None:
    """A reworded warning read as one removed and one added: two changes for one. Only the figures may differ."""
    from dora.report import plan_diff, render_diff

    stall = "the trainer waits {}% of each step for the oldest version's tail at k=3: raising it trains {}% more"
    old = {"warnings": [stall.format(25, 5), "the placement uses 60 of the cluster's 64 accelerators"]}
    new = {"warnings": [stall.format(39, "-0.5"), "training memory is planned at 79.6 of 79.6 GiB"]}
    changes = plan_diff(old, new)
    assert changes == [("~", "warning", stall.format(25, 5), stall.format(39, "-0.5")),
                       ("-", "warning", "the placement uses 60 of the cluster's 64 accelerators", None),
                       ("+", "warning", None, "training memory is planned at 79.6 of 79.6 GiB")]
    assert render_diff(changes, "a", "b")[-1] == "Plan: 1 to add, 1 to change, 1 to remove."
    assert plan_diff(old, old) == []
