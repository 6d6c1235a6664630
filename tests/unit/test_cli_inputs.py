"""Awkward input to the commands around `dora plan`: odd file names, saved plans moved or edited by hand, overrides a
spec forbids, output places that cannot be written. Each gets a clean error (or just works), never an internal error,
and nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from dora.cli import main

TINY = REPO / "specs" / "local-tiny.yaml"
GOLDEN_PLAN = REPO / "tests" / "golden" / "plans" / "local-tiny.plan.json"


def test_file_names_with_square_brackets_are_printed_as_written(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a[").mkdir()
    shutil.copy(TINY, tmp_path / "a[" / "x].yaml")  # rich would read "[/x]" as a closing tag
    shutil.copy(TINY, tmp_path / "v[red].yaml")  # ... and "[red]" as a style
    bad = tmp_path / "b[bold].yaml"
    bad.write_text(TINY.read_text().replace("prompts_per_step: 16", "prompts_per_step: -16"))
    assert main(["validate", "a[/x].yaml", "v[red].yaml"]) == 0
    out = capsys.readouterr().out
    assert "ok a[/x].yaml" in out and "ok v[red].yaml" in out
    assert main(["validate", "b[bold].yaml"]) == 2
    err = capsys.readouterr().err
    assert "error: b[bold].yaml: 1 problem" in err and "workload.prompts_per_step" in err and "internal" not in err


def test_a_mode_override_the_spec_forbids_is_refused_like_the_spec_would_be(capsys) -> None:
    assert main(["apply", str(TINY), "--mode", "partial-rollout", "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "--mode partial-rollout" in err and "allow_version_mixing" in err and "internal" not in err


def test_a_mode_override_drops_the_streaming_only_pins() -> None:
    from dora.apply import plan_for_apply

    assert yaml.safe_load(TINY.read_text())["placement"]["rollout"]["versions_per_engine"] > 1
    _, plan = plan_for_apply(str(TINY), "sync", None)
    assert plan.mode == "sync" and plan.rollout.versions_per_engine == 1


def test_status_of_a_spec_that_does_not_load_is_a_clean_error(tmp_path: Path, capsys) -> None:
    assert main(["status", str(tmp_path / "nope.yaml")]) == 2  # bad input; 1 is for an unreachable cluster
    err = capsys.readouterr().err
    assert "cannot read the spec" in err and "dora validate" in err and "internal" not in err


def test_status_of_a_local_run_points_at_its_summary(tmp_path: Path, capsys) -> None:
    (tmp_path / "summary.json").write_text("{}")
    assert main(["stop", str(tmp_path)]) == 2
    assert "holds a local run, not a submitted job" in capsys.readouterr().err
    (tmp_path / "job.json").write_text("not json")
    assert main(["status", str(tmp_path)]) == 2
    assert "is not a dora job record" in capsys.readouterr().err
    (tmp_path / "job.json").write_text(json.dumps({"address": "http//head:8265", "submission_id": "raysubmit_x"}))
    assert main(["stop", str(tmp_path)]) == 2  # an edited record: refused, not waited on for 40 s
    assert "its address 'http//head:8265' is neither a URL nor HOST:PORT" in capsys.readouterr().err


def test_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path: Path, capsys) -> None:
    from dora.runtime.checkpoint import FORMAT, checkpoint_dir

    run = tmp_path / "run"
    checkpoint_dir(run).mkdir(parents=True)
    (checkpoint_dir(run) / "checkpoint.json").write_text(json.dumps(
        {"format": FORMAT, "step": 3, "consumed_groups": [0], "trainer_state": "trainer-3.pt", "step_event": None,
         "config_key": "another-job"}))
    (checkpoint_dir(run) / "trainer-3.pt").write_bytes(b"")
    (run / "runtime.json").write_text("the earlier run's config")
    assert main(["apply", str(TINY), "--output-dir", str(run), "--steps", "5", "--no-live"]) == 2
    assert "different job configuration" in capsys.readouterr().err
    assert (run / "runtime.json").read_text() == "the earlier run's config"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "runtime.json"]
    assert sorted(p.name for p in checkpoint_dir(run).iterdir()) == ["checkpoint.json", "trainer-3.pt"]


def test_a_saved_plan_finds_its_spec_from_another_directory(tmp_path: Path, monkeypatch) -> None:
    from dora.apply import ApplyInputError, plan_for_apply
    from dora.planning import _portable

    project = tmp_path / "project"  # planned there as `dora plan specs/local-tiny.yaml --out plans/tiny`
    (project / "specs").mkdir(parents=True)
    shutil.copy(TINY, project / "specs" / "local-tiny.yaml")
    (project / "plans" / "tiny").mkdir(parents=True)
    shutil.copy(GOLDEN_PLAN, project / "plans" / "tiny" / "plan.json")
    assert json.loads(GOLDEN_PLAN.read_text())["spec_file"] == "specs/local-tiny.yaml"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resolved, plan = plan_for_apply(str(project / "plans" / "tiny"), None, None)
    assert Path(resolved.file).resolve() == project / "specs" / "local-tiny.yaml"
    assert plan.spec_hash == resolved.spec_hash

    (project / "specs" / "local-tiny.yaml").unlink()
    with pytest.raises(ApplyInputError, match="its spec_file, relative to the directory `dora plan` ran in"):
        plan_for_apply(str(project / "plans" / "tiny" / "plan.json"), None, None)
    # a spec_file no file can have (hand-edited: too long, a NUL byte) is not found, not an internal error
    saved = json.loads(GOLDEN_PLAN.read_text())
    for impossible in ("s" * 5000 + ".yaml", "specs/a\0b.yaml"):
        (project / "plans" / "tiny" / "plan.json").write_text(json.dumps({**saved, "spec_file": impossible}))
        with pytest.raises(ApplyInputError, match="its spec_file, relative to the directory `dora plan` ran in"):
            plan_for_apply(str(project / "plans" / "tiny"), None, None)
    # a spec outside the working directory is recorded with a relative path, never as its bare name
    assert _portable(str(tmp_path / "other" / "s.yaml")) == "../other/s.yaml"


@pytest.mark.parametrize(("field", "value", "message"), [
    (("rollout", "tp"), 0, "plan.rollout.tp: expected a whole number >= 1, got 0"),
    (("mode",), "warp", "plan.mode: 'warp' is not one of"),
    (("predictions", "step_time_s"), "fast", "plan.predictions.step_time_s: expected a finite number"),
    (("predictions", "step_time_s"), float("nan"), "plan.predictions.step_time_s: expected a finite number"),
    (("spec_file",), None, "plan.spec_file: expected str, got None"),
    (("warnings",), "hi", "plan.warnings: expected a list"),
])
def test_a_hand_edited_plan_is_refused_at_the_field(tmp_path: Path, field, value, message) -> None:
    from dora.plan_cmd import PlanFileError, read_plan_file

    data = json.loads(GOLDEN_PLAN.read_text())
    read_plan_file(str(GOLDEN_PLAN))  # as written, it reads
    where = data
    for key in field[:-1]:
        where = where[key]
    where[field[-1]] = value
    edited = tmp_path / "plan.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_plan_file(str(edited))


def test_diff_takes_plan_directories_and_json_specs(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    plan_dir = tmp_path / "saved"
    plan_dir.mkdir()
    shutil.copy(GOLDEN_PLAN, plan_dir / "plan.json")
    assert main(["diff", str(plan_dir), str(plan_dir / "plan.json"), "--detailed-exitcode"]) == 0
    assert "No changes" in capsys.readouterr().out
    json_spec = tmp_path / "tiny.json"
    json_spec.write_text(json.dumps(yaml.safe_load(TINY.read_text())))
    assert main(["diff", str(TINY), str(json_spec), "--detailed-exitcode"]) == 0
    assert main(["diff", str(plan_dir), str(tmp_path / "missing.json")]) == 2  # an input error, as in `dora plan`
    (tmp_path / "empty.json").write_text("{}")
    assert main(["diff", str(plan_dir), str(tmp_path / "empty.json"), "--detailed-exitcode"]) == 1
    assert "is not a dora plan (it has no format_version)" in capsys.readouterr().err


def test_plan_out_writes_nothing_when_one_of_its_files_is_blocked(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "plan"
    (out / "timeline.html").mkdir(parents=True)
    shutil.copy(GOLDEN_PLAN, out / "plan.json")  # an earlier plan's directory: dora's entries are its to replace
    assert main(["plan", str(TINY), "--out", str(out)]) == 2
    assert f"a directory is in the way of a plan file ({out / 'timeline.html'})" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "timeline.html"]
    assert (out / "plan.json").read_bytes() == GOLDEN_PLAN.read_bytes()


def test_calibrate_checks_its_output_path_before_measuring(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "a-directory"
    target.mkdir()
    assert main(["calibrate", str(TINY), "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {target}: it is a directory" in err and "decode" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-directory"]
    assert main(["calibrate", str(TINY), "--out", " "]) == 2
    assert "the path is empty" in capsys.readouterr().err


def test_examples_are_named_not_read_from_any_path(capsys) -> None:
    assert main(["examples", "local-tiny.yaml"]) == 0
    assert capsys.readouterr().out == TINY.read_text()
    for name in ("/etc/hostname", "../specs/local-tiny", str(TINY.with_suffix(""))):
        assert main(["examples", name]) == 2
        assert capsys.readouterr().out == ""


def test_flags_that_would_be_ignored_are_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    assert main(["plan", str(TINY), "--detailed-exitcode"]) == 1
    assert "add --against" in capsys.readouterr().err
    shutil.copy(GOLDEN_PLAN, tmp_path / "plan.json")
    assert main(["apply", str(tmp_path / "plan.json"), "--calibration", "cal.json", "--no-live"]) == 2
    assert "--calibration cannot change a saved plan" in capsys.readouterr().err


def test_a_ray_cluster_spec_is_submitted_to_its_own_address(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "cluster.yaml"
    spec.write_text(TINY.read_text().replace("backend: local", "backend: ray-cluster\n  address: http://127.0.0.1:9"))
    assert main(["apply", str(spec), "--output-dir", str(tmp_path / "out"), "--no-live"]) == 1
    assert "cannot reach the Ray Jobs API at http://127.0.0.1:9" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_plan_file_given_as_a_spec_says_so(capsys) -> None:
    assert main(["validate", str(GOLDEN_PLAN)]) == 2
    err = capsys.readouterr().err
    assert "this is a dora plan file, not a spec" in err and "specs/local-tiny.yaml" in err
    assert err.count("\n") == 3  # one problem, not one per plan field


def test_too_few_slots_for_a_prompt_group_names_the_flag(capsys) -> None:
    assert main(["apply", str(TINY), "--max-num-seqs", "4", "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs 4 is below workload.samples_per_prompt (8)" in err and "slots_per_group" not in err


def test_more_slots_than_can_ever_fill_and_an_endless_watchdog_are_refused(tmp_path: Path, capsys) -> None:
    assert main(["apply", str(TINY), "--max-num-seqs", "1000000000000", "--no-live",
                 "--output-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs 1,000,000,000,000 is more than the" in err and "use at most" in err
    for value in ("inf", "nan", "0", "1e-320", "0.5"):
        assert main(["apply", str(TINY), "--watchdog-s", value, "--no-live", "--output-dir", str(tmp_path / "b")]) == 2
        assert "--watchdog-s must be a number of seconds, at least 1" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("out", [" ", "\u200b", "a\x1bb"])
def test_an_empty_invisible_or_control_character_output_dir_is_refused(tmp_path: Path, capsys, monkeypatch,
                                                                       out: str) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["apply", str(TINY), "--no-live", "--output-dir", out]) == 2
    err = capsys.readouterr().err
    assert "--output-dir: " in err and "runtime.output_dir (runs/local-tiny)" in err
    assert list(tmp_path.iterdir()) == []


def test_a_refused_resume_names_the_settings_that_changed(tmp_path: Path, capsys) -> None:
    from dora.apply import ApplyOverrides, plan_for_apply, runtime_config_for
    from dora.runtime.checkpoint import FORMAT, checkpoint_dir, config_key

    run = tmp_path / "run"
    resolved, plan = plan_for_apply(str(TINY), None, None)
    earlier = json.loads(runtime_config_for(resolved, ApplyOverrides(max_num_seqs=32, output_dir=str(run)),
                                            plan).to_json())
    checkpoint_dir(run).mkdir(parents=True)
    (checkpoint_dir(run) / "trainer-1.pt").write_bytes(b"")
    (checkpoint_dir(run) / "checkpoint.json").write_text(json.dumps(
        {"format": FORMAT, "step": 1, "consumed_groups": [0], "trainer_state": "trainer-1.pt", "step_event": None,
         "config_key": config_key(earlier)}))
    (run / "runtime.json").write_text(json.dumps(earlier))
    assert main(["apply", str(TINY), "--output-dir", str(run), "--steps", "5", "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "different job configuration (max_num_seqs: 32 -> " in err


def test_diff_of_two_specs_shows_the_inputs_that_changed_and_warnings_one_by_one(tmp_path: Path, capsys,
                                                                                 monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    bigger = tmp_path / "bigger.yaml"
    # 8 slots for twice the batch: rollout bounds the plan, and warnings say so
    bigger.write_text(TINY.read_text().replace("prompts_per_step: 16 ", "prompts_per_step: 32 ")
                      .replace("max_num_seqs: 40", "max_num_seqs: 8"))
    assert main(["diff", str(TINY), str(bigger)]) == 0
    out = capsys.readouterr().out
    assert "Inputs (spec):\n  ~ placement.rollout.max_num_seqs: 40 -> 8  (-80.0%)\n  ~ workload.prompts_per_step: 16 -> 32" in out
    assert "\nPlan:\n" in out and "~ predictions.step_time_s" in out
    assert not any(line.lstrip().startswith("~ warnings") for line in out.splitlines())
    assert "  + warning: " in out  # each warning on its own line


def test_plan_json_against_keeps_stdout_the_plan_and_reports_the_diff_on_stderr(tmp_path: Path, capsys,
                                                                                 monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    edited = json.loads(GOLDEN_PLAN.read_text())
    edited["predictions"]["step_time_s"] *= 2
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps(edited))
    assert main(["plan", "specs/local-tiny.yaml", "--json", "--against", str(saved), "--detailed-exitcode"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["spec_name"] == "local-tiny"
    assert "~ predictions.step_time_s" in captured.err


def test_an_empty_output_dir_and_a_hand_written_calibration_say_what_they_are(tmp_path: Path, capsys) -> None:
    assert main(["apply", str(TINY), "--output-dir", "", "--no-live"]) == 2
    assert "--output-dir: the path is empty" in capsys.readouterr().err  # it used to run into the spec's directory
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"cpu_compute_efficiency": 0.5}))
    assert main(["plan", str(TINY), "--calibration", str(calibration)]) == 0
    out = capsys.readouterr().out
    assert f"calibration: file {calibration}" in out and "catalog defaults (" not in out  # it sets one of them
    assert "partly calibrated" in out
    # the same CPU file for a GPU spec sets none of what that plan uses: it said "partly calibrated" all the same
    assert main(["plan", str(REPO / "specs" / "dense-8b-h800x64.yaml"), "--calibration", str(calibration)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "calibrated, but not for this plan" in out and "partly calibrated" not in out
    assert "on the target machines (h800), fit the trainer's MFU with `python bench/megatron_train.py" in out
    assert "`dora calibrate` measures the cpu engines only" in out


@pytest.mark.parametrize("address, problem", [
    ("http//head:8265", "is neither a URL nor HOST:PORT"),  # Ray waited ~40 s on it as a GCS address
    ("head:8265", "is read as a GCS address without http://"),
    ("ftp://head:8265", "has scheme ftp://"),  # Ray tried to import a module named ftp
    ("http://head:99999", "is not a valid URL"),
    ("http://:8265", "names no host"),
    ("head:port", "has port 'port'"),
    ("", "is empty"),
    ("http://head:8265/a b", "contains spaces or control characters"),
])
def test_a_malformed_cluster_address_is_refused_before_planning(tmp_path: Path, capsys, monkeypatch, address,
                                                                 problem) -> None:
    import dora.apply

    def no_planning(*args, **kwargs):
        raise AssertionError("planned before checking --address")

    monkeypatch.setattr(dora.apply, "plan_for_apply", no_planning)
    assert main(["apply", str(TINY), "--address", address, "--output-dir", str(tmp_path / "out"), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert f"--address {address!r} {problem}" in err and "http://HEAD:8265 (the Ray dashboard)" in err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("address", ["http://head:8265", "https://10.0.0.7:443", "ray://head:10001", "head:6379",
                                     "[::1]:6379", "http://[::1]:8265", "auto",
                                     "http://ray_head:8265", "raycluster-head-svc.default.svc.cluster.local:6379"])
def test_every_address_form_ray_reads_is_accepted(address) -> None:
    from dora.spec.checks import address_problem

    assert address_problem(address) is None


def test_the_jobs_client_is_given_the_address_dora_names_not_the_environment_s(monkeypatch) -> None:
    import ray.job_submission

    from dora import cluster

    seen = {}

    def client(address):  # Ray's client reads the two variables in its constructor, and prefers them to `address`
        seen.update(address=address, env={name: cluster.os.environ.get(name) for name in cluster.RAY_ADDRESS_VARIABLES})
        return "client"

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", client)
    monkeypatch.setenv("RAY_ADDRESS", "http://other:8265")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://another:8265")
    assert cluster._client("http://head:8265") == "client"
    assert seen == {"address": "http://head:8265", "env": {"RAY_API_SERVER_ADDRESS": None, "RAY_ADDRESS": None}}
    assert cluster.os.environ["RAY_ADDRESS"] == "http://other:8265"  # restored for everything else
    assert cluster.os.environ["RAY_API_SERVER_ADDRESS"] == "http://another:8265"


_CORRUPT_JSON = {
    "deep": ('{"format_version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),  # RecursionError
    "long-int": ('{"format_version": 1, "x": ' + "1" * 5000 + "}", "an integer of 5,000 digits"),  # int()'s limit
    "float-int": ('{"format_version": 1, "x": ' + "1" * 400 + "}", "an integer of 400 digits"),  # float() overflow
}


@pytest.mark.parametrize("kind", sorted(_CORRUPT_JSON))
@pytest.mark.parametrize("command", ["against", "calibration", "diff"])
def test_a_plan_or_calibration_file_python_cannot_parse_is_refused(tmp_path: Path, capsys, kind, command) -> None:
    content, why = _CORRUPT_JSON[kind]
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    what = "calibration file" if command == "calibration" else "plan file"
    argv = ["diff", str(bad), str(GOLDEN_PLAN)] if command == "diff" else ["plan", str(TINY), f"--{command}", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{what} '{bad}' is not readable JSON: " in err and why in err and "internal" not in err


@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
@pytest.mark.parametrize("command", ["against", "calibration", "diff"])
def test_a_plan_or_calibration_path_that_is_not_a_regular_file_is_refused(tmp_path: Path, target, command) -> None:
    import subprocess
    import sys

    path = "/dev/zero"
    if target == "fifo":  # a FIFO hung `dora plan --against` forever, /dev/zero was read to a MemoryError
        path = str(tmp_path / "plan.json")
        os.mkfifo(path)
    argv = ["diff", path, str(GOLDEN_PLAN)] if command == "diff" else ["plan", str(TINY), f"--{command}", path]
    proc = subprocess.run([sys.executable, "-m", "dora.cli", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "internal" not in proc.stderr, proc.stderr
    assert "is not a regular file (a device, pipe or socket)" in proc.stderr and path in proc.stderr


@pytest.mark.parametrize("flag", ["--out", "--against", "--calibration"])
def test_an_empty_path_flag_is_refused(tmp_path: Path, capsys, monkeypatch, flag) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(TINY), flag, ""]) == 2  # an empty --out planned, wrote nothing and exited 0
    assert f"{flag} is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_job_record_nested_too_deeply_is_not_a_job_record(tmp_path: Path, capsys) -> None:
    (tmp_path / "job.json").write_text("[" * 100_000 + "]" * 100_000)  # RecursionError, an internal error before
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a dora job record: it nests too deeply" in err and "internal" not in err


@pytest.mark.parametrize("record", ["[]", '"str"', "null", "3"])
def test_a_job_record_that_is_not_an_object_says_what_it_holds(tmp_path: Path, capsys, record: str) -> None:
    (tmp_path / "job.json").write_text(record)
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"is not a dora job record: it holds {record} instead of an object" in err and "indices" not in err


@pytest.mark.parametrize("values", ["null", "[1]", '"x"'])
def test_a_calibration_that_is_not_an_object_says_so(tmp_path: Path, capsys, values: str) -> None:
    (tmp_path / "cal.json").write_text('{"calibration": ' + values + '}')
    assert main(["plan", str(TINY), "--calibration", str(tmp_path / "cal.json")]) == 2
    err = capsys.readouterr().err
    assert '"calibration" must be an object of constants' in err and "NoneType" not in err


@pytest.mark.parametrize("document", ['{"calibration": {}}', "{}", '{"calibration": {"source": "me"}}'])
def test_a_calibration_file_that_sets_no_constant_is_refused(tmp_path: Path, capsys, document: str) -> None:
    """It planned on catalog defaults while the report named the file as the calibration (and so left out the
    "uncalibrated" warning)."""
    (tmp_path / "cal.json").write_text(document)
    assert main(["plan", str(TINY), "--calibration", str(tmp_path / "cal.json")]) == 2
    assert "sets no constants" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_jobs_api_that_never_answers_is_given_up_on(tmp_path: Path, capsys, monkeypatch, command: str) -> None:
    """A server that accepts the connection and never answers (or a host that drops packets) held `dora status`
    for as long as Ray's client waited: without end. Now ``ANSWER_TIMEOUT_S``, then exit 1 with a message."""
    import socket
    import threading
    import time

    from dora import cluster

    monkeypatch.setattr(cluster, "ANSWER_TIMEOUT_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshakes; nothing reads or answers
        address = f"http://127.0.0.1:{silent.getsockname()[1]}"
        (tmp_path / "job.json").write_text(json.dumps({"address": address, "submission_id": "raysubmit_x",
                                                        "spec_name": "t", "mode": "sync",
                                                        "output_dir": str(tmp_path)}))
        started = time.monotonic()
        assert main([command, str(tmp_path)]) == 1
        assert time.monotonic() - started < 20
    # the socket is closed: the abandoned request fails and its thread ends (none is left for interpreter exit)
    for thread in [t for t in threading.enumerate() if t.name == "dora-ray-jobs"]:
        thread.join(30)
        assert not thread.is_alive()
    err = capsys.readouterr().err
    assert f"cannot reach the Ray Jobs API at {address}: no answer in 1 s" in err and "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", [["schema"], ["examples", "local-tiny"], ["examples"],
                                     ["validate", "--json", "specs/local-tiny.yaml"],
                                     ["plan", "specs/local-tiny.yaml", "--json"]])
def test_standard_output_on_a_full_disk_is_an_error_not_a_bug(command: list[str]) -> None:
    """Printed `internal error: OSError: [Errno 28] ... this is a bug in dora`."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "dora.cli", *command], stdout=full, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "error: cannot write to standard output: No space left on device" in proc.stderr
    assert "bug" not in proc.stderr and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_a_reader_that_goes_away_ends_the_command_as_sigpipe_would() -> None:
    """`dora validate specs/*.yaml | head -2` exited 1, the status of a spec error, after validating only the specs
    whose lines fit before head left; 141 is what `cat` or `git log` give there."""
    import subprocess
    import sys

    specs = sorted(str(p.relative_to(REPO)) for p in (REPO / "specs").glob("*.yaml"))
    assert len(specs) > 2
    proc = subprocess.Popen([sys.executable, "-m", "dora.cli", "validate", *specs], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line, before the process has written all of them
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "bug" not in err


def test_an_os_error_not_from_standard_output_is_still_reported_as_a_bug(capsys, monkeypatch) -> None:
    import dora.cli

    def broken(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dora.cli, "cmd_schema", broken)
    assert main(["schema"]) == 1
    assert "internal error: OSError" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["c" * 256, "c" * 256 + "/x.json"])
def test_calibrate_refuses_a_name_too_long_before_measuring(tmp_path: Path, capsys, name: str) -> None:
    """It measured for minutes, then crashed on its temporary file's name (`.NAME.tmp`, 5 bytes longer)."""
    out = tmp_path / name
    assert main(["calibrate", str(TINY), "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {out}: the name 'ccc" in err and "is 256 bytes long" in err
    assert "to fix: give --out a shorter file name" in err and "decode" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_calibrate_tries_its_output_directory_before_measuring(capsys) -> None:
    """`os.access` says /proc is writable to root: the run measured, then failed to write."""
    assert main(["calibrate", str(TINY), "--quick", "--out", "/proc/x.json"]) == 2
    err = capsys.readouterr().err
    assert "cannot write /proc/x.json: " in err and "decode" not in err and "internal" not in err
    for other in ("/dev/null", "/proc/self"):
        assert main(["calibrate", str(TINY), "--quick", "--out", other]) == 2
        assert f"cannot write {other}: it is " in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value", "message"), [
    (("rollout", "max_num_seqs"), 10**12, "rollout.max_num_seqs 1,000,000,000,000 is more than the 384 trajectories"),
    (("rollout", "gpu_memory_utilization"), 5.0, "rollout.gpu_memory_utilization 5 is more than all of the memory"),
    (("rollout", "tp"), 64, "rollout.tp 64 is more than the cluster's 2 accelerators"),
    (("train", "pp"), 64, "train.pp 64 is more than the cluster's 2 accelerators"),
    (("train", "cp"), 2, "train.tp x pp x dp x cp = 1 x 1 x 1 x 2 is not train.accelerators 1"),
    # against the spec's placement pins (local-tiny: colocated false, 3 versions per engine, 40 slots)
    ((None, "colocated"), True, "colocated true, but placement.colocated pins false"),
    (("rollout", "max_num_seqs"), 64, "rollout.max_num_seqs 64, but placement.rollout.max_num_seqs pins at most 40"),
    (("rollout", "versions_per_engine"), 4, "rollout.versions_per_engine 4, but placement.rollout.versions_per_engine "
                                            "pins at most 3"),
])
def test_a_saved_plan_s_own_fields_get_the_bounds_of_the_flags(tmp_path: Path, capsys, monkeypatch, field, value,
                                                               message) -> None:
    """An edited plan.json (spec hash unchanged) passed every check with a value the flag refuses."""
    monkeypatch.chdir(REPO)
    data = json.loads(GOLDEN_PLAN.read_text())
    (data[field[0]] if field[0] else data)[field[1]] = value
    (tmp_path / "plan.json").write_text(json.dumps(data))
    # an address nothing listens on: a plan that passed its checks would fail to connect (exit 1), not exit 2
    assert main(["apply", str(tmp_path / "plan.json"), "--address", "http://127.0.0.1:9", "--no-live"]) == 2
    err = capsys.readouterr().err
    assert f"saved plan {tmp_path / 'plan.json'} breaks its spec specs/local-tiny.yaml: {message}" in err
    assert "run `dora plan specs/local-tiny.yaml --out" in err and "cannot reach" not in err


def test_the_bounds_on_a_saved_plan_pass_every_plan_dora_writes(tmp_path: Path) -> None:
    from dora.apply import _outside_spec, plan_for_apply

    small = tmp_path / "small.yaml"  # more slots than trajectories in flight: the planner's cap, not an edit
    small.write_text(TINY.read_text().replace("prompts_per_step: 16", "prompts_per_step: 1")
                     .replace("samples_per_prompt: 8", "samples_per_prompt: 2"))
    packed = tmp_path / "packed.yaml"  # a packing pinned above the 40 slots: the plan packs 40, within the pin
    packed.write_text(TINY.read_text().replace("    versions_per_engine: 3\n",
                                               "    versions_per_engine: 3\n    consolidation_batch: 64\n"))
    for spec, mode in ((TINY, None), (small, None), (small, "sync"), (packed, None)):
        resolved, plan = plan_for_apply(str(spec), mode, None)
        assert _outside_spec(plan, resolved.spec) == []
    assert plan.rollout.consolidation_batch == 40


@pytest.mark.parametrize(("document", "message"), [
    ('{"calibration": {"cpu_compute_efficiency": 0.5}, "extra": 1}', "unknown top-level key 'extra'"),
    ('{"calibration": {"cpu_compute_efficiency": 0.5}, "fit": []}', "did you mean 'fits'?"),
])
def test_a_calibration_file_with_an_unknown_key_beside_its_constants_is_refused(tmp_path: Path, capsys, document,
                                                                                 message) -> None:
    (tmp_path / "cal.json").write_text(document)
    assert main(["plan", str(TINY), "--calibration", str(tmp_path / "cal.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "holds only fits, format, machine, measurements, spec" in err


class _FakeJobs:
    """A Ray Jobs API client with no cluster behind it: records the submission, answers job info with the given
    statuses in turn (the last one repeats), streams the given log chunks, and can lose contact or refuse."""

    MESSAGES = {"PENDING": "Job has not started yet. It may be waiting for resources (CPUs, GPUs, memory, custom "
                           "resources) to become available.",
                "RUNNING": "Job is currently running.", "SUCCEEDED": "Job finished successfully."}

    NO_AGENT = ("Request failed with status code 500: No available agent to submit job, please try again "
                "later.")  # Ray 2.60's answer while the head's job agent has not registered

    def __init__(self, *, infos=("RUNNING", "SUCCEEDED"), logs=(), refuse=False, lose_contact=False,
                 no_agent=0) -> None:
        self.infos, self.logs, self.refuse, self.lose_contact = list(infos), list(logs), refuse, lose_contact
        self.no_agent = no_agent  # how many submissions are refused for want of a job agent first
        self.submitted: list[dict] = []
        self.uploaded: list[list[str]] = []

    def submit_job(self, **body):
        working_dir = Path(body["runtime_env"]["working_dir"])
        self.uploaded.append(sorted(p.name for p in working_dir.iterdir()))  # Ray packs and uploads it here
        if self.no_agent:
            self.no_agent -= 1
            raise RuntimeError(self.NO_AGENT)
        if self.refuse:
            raise RuntimeError("Request failed with status code 500: the cluster said no")
        self.submitted.append(body)
        return "raysubmit_fake"

    def get_job_info(self, submission_id):
        from types import SimpleNamespace

        status = self.infos.pop(0) if len(self.infos) > 1 else self.infos[0]
        return SimpleNamespace(status=SimpleNamespace(value=status), message=self.MESSAGES[status], entrypoint="x")

    async def tail_job_logs(self, submission_id):
        for chunk in self.logs:
            yield chunk

    def get_job_status(self, submission_id):
        from types import SimpleNamespace

        import requests

        if self.lose_contact:
            raise requests.exceptions.ConnectionError(
                "HTTPConnectionPool(host='head', port=8265): Max retries exceeded with url: /api/jobs/raysubmit_fake "
                "(Caused by NewConnectionError('Failed to establish a new connection: [Errno 111] Connection "
                "refused'))")
        return SimpleNamespace(value=self.infos[-1])


def _submit(tmp_path: Path, monkeypatch, jobs: _FakeJobs | None, *args: str) -> int:
    """`dora apply local-tiny --address http://head:8265 ARGS` against ``jobs`` (None: the cluster must not be
    contacted); job directories are made under ``tmp_path/tmp``."""
    import tempfile

    from dora import cluster

    def client(address):
        assert jobs is not None, "the cluster was contacted"
        return jobs

    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(cluster, "_client", client)
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    return main(["apply", str(TINY), "--address", "http://head:8265", "--steps", "2", "--no-live", *args])


def test_a_submission_leaves_no_job_directory_behind_whatever_its_outcome(tmp_path: Path, capsys, monkeypatch) -> None:
    """Every submission left a /tmp/dora-job-* directory (the job's working_dir, uploaded by submit_job), failed and
    interrupted ones too."""
    jobs = _FakeJobs(logs=["step 1/2\n", "step 2/2\n"])
    assert _submit(tmp_path, monkeypatch, jobs, "--output-dir", str(tmp_path / "out")) == 0, capsys.readouterr().err
    assert jobs.uploaded and "launch" in jobs.uploaded[0]  # it was there while Ray uploaded it
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "job raysubmit_fake: SUCCEEDED — Job finished successfully." in capsys.readouterr().err
    refused = _FakeJobs(refuse=True)
    assert _submit(tmp_path, monkeypatch, refused, "--output-dir", str(tmp_path / "refused")) == 1
    assert refused.uploaded and list((tmp_path / "tmp").iterdir()) == []
    assert "job submission to http://head:8265 failed: Request failed with status code 500" in capsys.readouterr().err

    class Interrupted(_FakeJobs):
        def submit_job(self, **body):
            super().submit_job(**body)
            raise KeyboardInterrupt  # Ctrl-C while Ray uploads

    interrupted = Interrupted()
    assert _submit(tmp_path, monkeypatch, interrupted, "--output-dir", str(tmp_path / "interrupted")) == 130
    assert interrupted.uploaded and list((tmp_path / "tmp").iterdir()) == []


def test_a_head_whose_job_agent_is_not_up_yet_is_tried_again(tmp_path: Path, capsys, monkeypatch) -> None:
    """A head started moments ago answers "No available agent to submit job, please try again later" until its
    job agent registers (CI met it); dora gave up at once. Other refusals are still not tried again."""
    from types import SimpleNamespace

    from dora import cluster

    jobs = _FakeJobs(no_agent=3, logs=["step 1/2\n"])
    assert _submit(tmp_path, monkeypatch, jobs, "--output-dir", str(tmp_path / "out")) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert len(jobs.uploaded) == 4 and len(jobs.submitted) == 1
    assert err.count("the cluster's head has no job agent yet (it may have just started): trying again for about "
                     "60 s") == 1
    assert json.loads((tmp_path / "out" / "job.json").read_text())["submission_id"] == "raysubmit_fake"
    clock = iter(range(0, 10_000, 25))  # each reading 25 s later: Ray's head waits 10 s per try, dora 1 s between
    monkeypatch.setattr(cluster, "time", SimpleNamespace(monotonic=lambda: float(next(clock)), sleep=lambda s: None))
    never = _FakeJobs(no_agent=100)
    assert _submit(tmp_path, monkeypatch, never, "--output-dir", str(tmp_path / "never")) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"job submission to http://head:8265 failed: {_FakeJobs.NO_AGENT} (refused so for 75 s)" in err
    assert len(never.uploaded) == 3 and not (tmp_path / "never" / "job.json").exists()
    monkeypatch.setattr(cluster, "AGENT_WAIT_S", 0.0)  # refused once, past the wait: Ray's answer, as it was
    late = _FakeJobs(no_agent=1)
    assert _submit(tmp_path, monkeypatch, late, "--output-dir", str(tmp_path / "late")) == 1
    err = capsys.readouterr().err
    assert f"job submission to http://head:8265 failed: {_FakeJobs.NO_AGENT}" in " ".join(err.split())
    assert "refused so for" not in err
    assert len(late.uploaded) == 1 and not (tmp_path / "late" / "job.json").exists()
    refused = _FakeJobs(refuse=True)
    assert _submit(tmp_path, monkeypatch, refused, "--output-dir", str(tmp_path / "refused")) == 1
    assert len(refused.uploaded) == 1  # any other refusal is not tried again


def test_the_driver_s_audit_line_is_read_when_the_logs_split_it(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "out"
    audit = json.dumps({"ok": True, "audit": {"num_consumed": 256}, "output_dir": str(out)})
    half = len(audit) // 2
    jobs = _FakeJobs(logs=["step 1/2\n", f"DORA_AUDIT {audit[:half]}", f"{audit[half:]}\n", "bye\n"])
    assert _submit(tmp_path, monkeypatch, jobs, "--output-dir", str(out)) == 0, capsys.readouterr().err
    assert json.loads((out / "cluster_audit.json").read_text())["audit"]["num_consumed"] == 256


def test_a_job_that_waits_for_resources_says_so_with_ray_s_message(tmp_path: Path, capsys, monkeypatch) -> None:
    """A cluster without the CPU the job's driver asks for kept it PENDING, and dora printed nothing at all."""
    from dora import cluster

    monkeypatch.setattr(cluster, "PENDING_NOTICE_S", 0.0)
    jobs = _FakeJobs(infos=["PENDING", "PENDING", "PENDING", "RUNNING", "SUCCEEDED"])
    assert _submit(tmp_path, monkeypatch, jobs, "--output-dir", str(tmp_path / "out")) == 0
    err = capsys.readouterr().err
    pending = [line for line in err.splitlines() if "PENDING" in line]
    assert len(pending) == 1, err  # said once, until Ray's message changes
    assert pending[0].startswith("job raysubmit_fake: PENDING — Job has not started yet. It may be waiting for "
                                 "resources")
    assert "Its driver asks for 1 CPU (entrypoint_num_cpus)" in pending[0]


def test_losing_the_cluster_while_following_a_job_is_an_error_not_a_bug(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "out"
    assert _submit(tmp_path, monkeypatch, _FakeJobs(lose_contact=True), "--output-dir", str(out)) == 1
    err = capsys.readouterr().err
    assert ("lost contact with http://head:8265 (ConnectionError: connection refused); the job may still be running: "
            f"`dora status {out}`") in " ".join(err.split())
    assert "internal error" not in err and "Traceback" not in err
    assert json.loads((out / "job.json").read_text())["submission_id"] == "raysubmit_fake"  # recorded for that


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_cluster_is_contacted(tmp_path: Path, capsys,
                                                                                         monkeypatch) -> None:
    """It was found only after submit_job ("internal error: FileExistsError"), leaving the job running."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for target in (blocker, blocker / "run"):
        assert _submit(tmp_path, monkeypatch, None, "--output-dir", str(target)) == 2
        err = capsys.readouterr().err
        assert f"cannot write the run's outputs to {target}/: {blocker} is a file, not a directory" in err
        assert "to fix: choose a writable directory with --output-dir" in err and "internal error" not in err
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_relative_output_dir_is_refused_for_a_cluster_job(tmp_path: Path, capsys, monkeypatch) -> None:
    """The job writes where its runtime.json says, relative to its working directory on the cluster: a temporary
    directory Ray removes. The outputs were lost while dora said "outputs in runs/rel/"."""
    monkeypatch.chdir(tmp_path)
    assert _submit(tmp_path, monkeypatch, None, "--output-dir", "runs/rel") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--output-dir 'runs/rel' is relative: a job submitted to a Ray cluster runs in a working directory" in err
    assert "give an absolute path on storage the cluster's nodes share" in err
    assert _submit(tmp_path, monkeypatch, None) == 2  # the spec's own runtime.output_dir, named with its line
    err = " ".join(capsys.readouterr().err.split())
    line = TINY.read_text().splitlines().index("  output_dir: runs/local-tiny") + 1
    assert f"runtime.output_dir ({TINY}, line {line}) 'runs/local-tiny' is relative" in err
    assert not (tmp_path / "runs").exists()


def test_a_job_still_running_after_its_logs_ended_is_said_to_be_no_longer_waited_for(tmp_path: Path, capsys,
                                                                                      monkeypatch) -> None:
    """dora waits a while for the final status once the logs end; when it gives up it printed 'job X: RUNNING' and
    exited 1 without saying that it had stopped waiting or how to follow the job."""
    from dora import cluster

    monkeypatch.setattr(cluster, "TERMINAL_WAIT_S", 0.0)
    monkeypatch.setattr(cluster._wait_terminal, "__defaults__", (0.0,))
    out = tmp_path / "out"
    assert _submit(tmp_path, monkeypatch, _FakeJobs(infos=("RUNNING",)), "--output-dir", str(out)) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "job raysubmit_fake: RUNNING" in err
    assert f"its logs ended, but the job is still RUNNING after 0 s: dora stopped waiting; `dora status {out}`" in err


def test_a_submission_into_a_directory_a_local_run_writes_is_refused_before_the_cluster_is_contacted(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """`dora apply --address` wrote its job.json into a directory a local run was writing (its run lock held), and
    into one holding a finished local run: the job would have resumed or overwritten that run's files."""
    from dora.runtime.runlock import run_dir_lock

    out = tmp_path / "out"
    out.mkdir()
    with run_dir_lock(out):  # a local `dora apply` of this directory is running
        assert _submit(tmp_path, monkeypatch, None, "--output-dir", str(out)) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out}/ is in use by a dora run (pid {os.getpid()} on " in err
    assert "to fix: wait for that run to end or stop it" in err and "give this submission another --output-dir" in err
    (out / "runtime.json").write_text("{}")
    (out / "summary.json").write_text("{}")
    assert _submit(tmp_path, monkeypatch, None, "--output-dir", str(out)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out}/ holds a local run, not a submitted job" in err
    assert "go on with the local run with `dora apply` without --address" in err
    assert not (out / "job.json").exists() and list((tmp_path / "tmp").iterdir()) == []


class _Recorded(_FakeJobs):
    """A cluster that also knows the job an earlier submission recorded (``raysubmit_old``): its status is ``old``, or
    it has no such job (None), or it cannot be asked (an exception)."""

    def __init__(self, old, **kwargs) -> None:
        super().__init__(**kwargs)
        self.old = old

    def get_job_status(self, submission_id):
        from types import SimpleNamespace

        if submission_id != "raysubmit_old":
            return super().get_job_status(submission_id)
        if self.old is None:
            raise RuntimeError("Request failed with status code 404: Job raysubmit_old does not exist.")
        if isinstance(self.old, Exception):
            raise self.old
        return SimpleNamespace(value=self.old)


def test_a_submission_into_the_directory_of_a_job_not_over_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    """A second submission into a directory whose job.json named a job still RUNNING overwrote the record (and its
    job wrote the same trace and checkpoints as the first): refused unless the cluster says that job is over."""
    import requests

    out = tmp_path / "out"
    out.mkdir()
    record = {"address": "http://head:8265", "submission_id": "raysubmit_old", "spec_name": "local-tiny",
              "mode": "sync", "output_dir": str(out)}
    refusals = {"RUNNING": f"{out}/ holds job raysubmit_old on http://head:8265, still RUNNING: a second job would "
                           f"write the same trace and checkpoints to fix: stop it first (`dora stop {out}`)",
                requests.exceptions.ConnectionError("Connection refused"):
                    f"{out}/job.json records job raysubmit_old on http://head:8265, and that cluster cannot be asked "
                    "whether it is over (ConnectionError: connection refused)"}
    for old, message in refusals.items():
        (out / "job.json").write_text(json.dumps(record))
        jobs = _Recorded(old)
        assert _submit(tmp_path, monkeypatch, jobs, "--output-dir", str(out)) == 1
        err = " ".join(capsys.readouterr().err.split())
        assert message in err and "give this submission another --output-dir" in err
        assert not jobs.submitted and json.loads((out / "job.json").read_text())["submission_id"] == "raysubmit_old"
    for old in ("STOPPED", None):  # over, or gone from the cluster: nothing of it writes there any more
        (out / "job.json").write_text(json.dumps(record))
        jobs = _Recorded(old)
        assert _submit(tmp_path, monkeypatch, jobs, "--output-dir", str(out)) == 0, capsys.readouterr().err
        assert jobs.submitted and json.loads((out / "job.json").read_text())["submission_id"] == "raysubmit_fake"
    (out / "job.json").write_text("[1, 2]")
    assert _submit(tmp_path, monkeypatch, None, "--output-dir", str(out)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out}/job.json is not a dora job record" in err and f"or remove {out}/job.json if no job of it runs" in err
    # the job over, its checkpoint another job's: the new job would refuse it on the cluster, after its submission
    from dora.runtime.checkpoint import FORMAT, checkpoint_dir

    (out / "job.json").write_text(json.dumps(record))
    checkpoint_dir(out).mkdir(parents=True)
    (checkpoint_dir(out) / "trainer-3.pt").write_bytes(b"")
    (checkpoint_dir(out) / "checkpoint.json").write_text(json.dumps(
        {"format": FORMAT, "step": 3, "consumed_groups": [0], "trainer_state": "trainer-3.pt", "step_event": None,
         "config_key": "another-job"}))
    jobs = _Recorded("SUCCEEDED")
    assert _submit(tmp_path, monkeypatch, jobs, "--output-dir", str(out)) == 2
    assert "different job configuration" in capsys.readouterr().err and not jobs.submitted


def test_what_is_not_the_cluster_s_fault_is_not_reported_as_lost_contact(tmp_path: Path, capsys, monkeypatch) -> None:
    """Every RuntimeError and OSError while following a job read "lost contact with the cluster": asyncio refusing to
    start a loop inside a running one, an audit line nested too deeply to parse, a closed standard output, and the
    cluster's answer that the job does not exist."""
    import asyncio
    import sys

    deep = "DORA_AUDIT " + "[" * 100_000 + "]" * 100_000 + "\n"
    assert _submit(tmp_path, monkeypatch, _FakeJobs(logs=[deep]), "--output-dir", str(tmp_path / "deep")) == 0
    assert "lost contact" not in capsys.readouterr().err and not (tmp_path / "deep" / "cluster_audit.json").exists()

    async def from_async_code() -> int:  # a notebook's running event loop
        return _submit(tmp_path, monkeypatch, _FakeJobs(logs=["step 1/2\n"]), "--output-dir", str(tmp_path / "loop"))

    assert asyncio.run(from_async_code()) == 0
    captured = capsys.readouterr()
    assert "step 1/2" in captured.out and "lost contact" not in captured.err

    class Closed:  # `dora apply ... | head` after head exited
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", Closed())
        code = _submit(tmp_path, monkeypatch, _FakeJobs(logs=["step 1/2\n"]), "--output-dir", str(tmp_path / "pipe"))
    err = " ".join(capsys.readouterr().err.split())
    assert code == 141 and "lost contact" not in err
    assert (f"standard output closed: stopped following raysubmit_fake; the job keeps running: `dora status "
            f"{tmp_path / 'pipe'}`") in err

    class Deleted(_FakeJobs):
        def get_job_info(self, submission_id):
            raise RuntimeError(f"Request failed with status code 404: Job {submission_id} does not exist.")

    assert _submit(tmp_path, monkeypatch, Deleted(), "--output-dir", str(tmp_path / "gone")) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "http://head:8265 has no job raysubmit_fake any more (RuntimeError: Request failed with status code 404: " \
           "Job raysubmit_fake does not exist.): it was deleted, or the cluster restarted" in err
    assert "lost contact" not in err


@pytest.mark.parametrize(("document", "message"), [
    ('{"format": "dora-calibration/1", "fits": [], "spec": {"name": "x"}, "cpu_compute_efficiency": 0.5}',
     'has no "calibration" object: its top-level keys (fits, format, spec) are those of a file `dora calibrate` '
     'writes, whose constants are under "calibration"'),
    ('{"format": "dora-calibration/9", "calibration": {"cpu_compute_efficiency": 0.5}}',
     'has format "dora-calibration/9", and this dora reads "dora-calibration/1": write it again with this dora\'s '
     "`dora calibrate`"),
], ids=["no-calibration-object", "unknown-format"])
def test_a_calibration_file_without_its_constants_object_or_of_another_format_says_so(tmp_path: Path, capsys, document,
                                                                                      message) -> None:
    """A file missing its "calibration" object was read as a bare constants object ("unknown calibration key
    'fits'"); an unknown format was accepted silently."""
    (tmp_path / "cal.json").write_text(document)
    assert main(["plan", str(TINY), "--calibration", str(tmp_path / "cal.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "unknown calibration key" not in err


@pytest.mark.parametrize("argv", [
    ["apply", ""], ["apply", str(TINY), "--calibration", ""],
    ["diff", "", str(TINY)], ["diff", str(TINY), ""], ["diff", str(TINY), str(TINY), "--calibration", ""],
    ["status", ""], ["stop", ""], ["calibrate", str(TINY), "--from-run", ""], ["calibrate", str(TINY), "--out", ""],
])
def test_an_empty_path_argument_is_refused_not_read_as_the_working_directory(argv, tmp_path: Path, capsys,
                                                                             monkeypatch) -> None:
    """`dora apply ''` ran a plan.json it found in the working directory; `dora status ''` looked for job.json there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert ": is empty: name " in err and "Traceback" not in err


def test_plan_out_on_a_file_is_refused_before_planning(tmp_path: Path, capsys) -> None:
    """A file where --out's directory (or a parent of it) would be: refused only after the plan ran and its report
    printed."""
    (tmp_path / "f").write_text("mine")
    for out, what in ((tmp_path / "f", "the path is a file"), (tmp_path / "f" / "x", f"its parent {tmp_path / 'f'} is a file")):
        assert main(["plan", str(TINY), "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no report: refused before planning
        assert f"cannot write the plan to {out}/: {what}, not a directory" in captured.err
    assert (tmp_path / "f").read_text() == "mine"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_plan_out_where_no_directory_can_be_made_is_refused_before_planning(capsys) -> None:
    """`os.access` says /proc is writable to root; /proc/self is not. Both were refused only after the report, the
    first as "No such file or directory (/proc)"."""
    for out, why in (("/proc/self/x", "/proc/self/ is not writable"),
                     ("/proc/x", "cannot make a directory in /proc/: ")):
        assert main(["plan", str(TINY), "--out", out]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no report: refused before planning
        assert f"cannot write the plan to {out}/: {why}" in captured.err, captured.err


def test_plan_out_probe_leaves_nothing_behind(tmp_path: Path, capsys) -> None:
    """The directory the check makes to try the filesystem is gone once the plan is written."""
    from dora.plan_cmd import PROBE_PREFIX

    assert main(["plan", str(TINY), "--out", str(tmp_path / "p")]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
    assert not [p for p in (tmp_path / "p").iterdir() if p.name.startswith(PROBE_PREFIX)]


def test_plan_out_warns_when_the_launch_it_wrote_will_not_submit(tmp_path: Path, capsys) -> None:
    """A RoPE scaling megatron-core cannot express, or no checkpoint: launch.sh refuses to submit, and only
    launch/NOTES.txt said so; `dora plan --out` printed nothing about it."""
    config = json.loads((REPO / "tests" / "data" / "hf_configs" / "qwen3-8b.json").read_text())
    config["rope_scaling"] = {"rope_type": "foo", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = yaml.safe_load((REPO / "specs" / "dense-8b-h800x64.yaml").read_text())
    spec["cluster"]["nodes"], spec["workload"]["prompts_per_step"] = 1, 16  # plans in a fraction of a second
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(spec))
    spec["model"] = {"hf_config": str(tmp_path / "config.json"), "checkpoint": "Qwen/Qwen3-8B", "dtype": "bf16"}
    (tmp_path / "rope.yaml").write_text(yaml.safe_dump(spec))
    del spec["model"]["checkpoint"]
    spec["model"]["preset"] = "qwen3-8b"
    del spec["model"]["hf_config"]
    (tmp_path / "nock.yaml").write_text(yaml.safe_dump(spec))
    expected = {"rope": "launch.sh will not submit the job: megatron-core cannot express this architecture: RoPE "
                        "scaling 'foo' (factor 4.0)",
                "nock": "launch.sh will not submit the job: model.checkpoint is not set"}
    for name, warning in expected.items():
        assert main(["plan", str(tmp_path / f"{name}.yaml"), "--out", str(tmp_path / name)]) == 0
        err = " ".join(capsys.readouterr().err.split())
        assert f"warning: {warning}" in err, err
        assert "BLOCKED: " in (tmp_path / name / "launch" / "NOTES.txt").read_text()
    assert main(["plan", str(tmp_path / "ok.yaml"), "--out", str(tmp_path / "ok")]) == 0
    assert "will not submit" not in capsys.readouterr().err
    assert "BLOCKED: " not in (tmp_path / "ok" / "launch" / "NOTES.txt").read_text()


def test_a_local_output_dir_on_a_file_says_so(tmp_path: Path, capsys) -> None:
    """mkdir's EEXIST read 'File exists' for a file where the run's directory would be."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for target in (blocker, blocker / "run"):
        assert main(["apply", str(TINY), "--output-dir", str(target), "--no-live"]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the run's outputs to {target}/: {blocker} is a file, not a directory" in err
    assert blocker.read_text() == "not a directory"
