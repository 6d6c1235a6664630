"""Lowering: golden artifacts for every example spec, determinism, file sets, atomic writing, plan checks."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import assert_golden
from test_lower_plans import EXAMPLE_SPECS, REPO, example_plan, load_example

from dora.lower import LoweringError, build_context, render_launch, write_launch_artifacts
from dora.lower import render as render_module
from dora.runtime.config import RuntimeConfig

GOLDEN = REPO / "tests" / "golden" / "launch"
GPU_FILES = {"launch/vllm/engine_args.json", "launch/megatron/config.json", "launch/megatron/args.txt"}
COMMON_FILES = {"launch/job.json", "launch/placement_groups.json", "launch/runtime.json", "launch/launch.sh",
                "launch/NOTES.txt"}


def _render(stem: str) -> dict[str, str]:
    resolved = load_example(stem)
    return render_launch(resolved, example_plan(resolved, stem))


@pytest.mark.parametrize("stem", EXAMPLE_SPECS)
def test_artifacts_match_golden_files(stem: str, update_golden: bool) -> None:
    files = _render(stem)
    folder = GOLDEN / stem
    if update_golden and folder.exists():
        shutil.rmtree(folder)  # drop files an earlier lowering produced and this one does not
    for rel, text in files.items():
        assert_golden(folder / rel, text, update_golden)
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert on_disk == set(files), "golden folder holds other files than the lowering produces"


@pytest.mark.parametrize("stem", EXAMPLE_SPECS)
def test_rendering_is_deterministic_and_sorted(stem: str) -> None:
    first, second = _render(stem), _render(stem)
    assert first == second
    assert list(first) == sorted(first)


def test_file_set_depends_on_engines_and_accelerator() -> None:
    assert set(_render("local-tiny")) == COMMON_FILES
    assert set(_render("dense-8b-h800x64")) == COMMON_FILES | GPU_FILES | {"launch/vllm/serve.args"}
    # No checkpoint in the spec: nothing for `vllm serve` to load, so no serve line, and launch.sh refuses.
    no_checkpoint = _render("moe-560b-x4096")
    assert set(no_checkpoint) == COMMON_FILES | GPU_FILES
    assert "exit 2" in no_checkpoint["launch/launch.sh"]
    assert "model.checkpoint is not set" in no_checkpoint["launch/NOTES.txt"]


@pytest.mark.parametrize("stem", EXAMPLE_SPECS)
def test_launch_sh_parses_and_json_artifacts_load(stem: str, tmp_path: Path) -> None:
    files = _render(stem)
    script = tmp_path / "launch.sh"
    script.write_text(files["launch/launch.sh"])
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert files["launch/launch.sh"].splitlines()[:1] == ["#!/usr/bin/env bash"]
    assert "set -euo pipefail" in files["launch/launch.sh"]
    for rel, text in files.items():
        if rel.endswith(".json"):
            json.loads(text)
    RuntimeConfig.from_json(files["launch/runtime.json"])


@pytest.mark.parametrize("stem", EXAMPLE_SPECS)
def test_placement_groups_match_the_plan(stem: str) -> None:
    resolved = load_example(stem)
    plan = example_plan(resolved, stem)
    groups = json.loads(render_launch(resolved, plan)["launch/placement_groups.json"])
    per_node = resolved.spec.cluster.accelerators_per_node
    by_name = {g["name"]: g for g in groups["placement_groups"]}
    assert len(by_name) == len(groups["placement_groups"])  # unique names
    gpu = resolved.spec.cluster.accelerator != "cpu"
    for g in groups["placement_groups"]:  # none larger than a node: Ray keeps a STRICT_PACK group on one
        assert g["strategy"] == "STRICT_PACK" and 1 <= len(g["bundles"]) <= per_node
        assert all(b == ({"CPU": 4, "GPU": 1} if gpu else {"CPU": 1}) for b in g["bundles"])
    assert len(groups["rollout_replicas"]) == plan.rollout.replicas
    ranks = [tuple(b) for r in groups["rollout_replicas"] for b in r["bundles"]]
    assert all(len(r["bundles"]) == plan.rollout.accelerators_per_replica for r in groups["rollout_replicas"])
    trainer = [tuple(b) for b in groups["trainer"]["bundles"]]
    assert len(trainer) == plan.train.accelerators and len(set(trainer)) == len(trainer)
    for pg, index in ranks + trainer:
        assert 0 <= index < len(by_name[pg]["bundles"])
    if plan.colocated:  # node groups the replicas split and the trainer time-shares
        assert {g["role"] for g in by_name.values()} == {"shared"} and len(set(ranks)) == len(ranks)
        assert set(trainer) <= set(ranks) and "shared" in groups["strategy_why"]
    else:  # a replica's or the trainer's groups are its own
        assert {g["role"] for g in by_name.values()} == {"rollout", "train"}
        assert not set(ranks) & set(trainer) and len(set(ranks)) == len(ranks)
    # a TP group that fits a node lies inside one: consecutive ranks fill one node's group before the next
    for r in groups["rollout_replicas"]:
        if plan.rollout.accelerators_per_replica <= per_node and per_node % plan.rollout.accelerators_per_replica == 0:
            assert len({pg for pg, _ in r["bundles"]}) == 1


def test_colocated_plan_shares_node_groups() -> None:
    resolved = load_example("dense-8b-h800x64")
    plan = example_plan(resolved, "dense-8b-h800x64")
    plan = dataclasses.replace(
        plan, colocated=True,
        rollout=dataclasses.replace(plan.rollout, accelerators=64, tp=2, ep=1, replicas=32, accelerators_per_replica=2),
        train=dataclasses.replace(plan.train, accelerators=64, tp=2, pp=1, cp=1, ep=1, dp=32))
    files = render_launch(resolved, plan)
    groups = json.loads(files["launch/placement_groups.json"])
    names = [g["name"] for g in groups["placement_groups"]]
    assert len(names) == 8 and all(len(g["bundles"]) == 8 for g in groups["placement_groups"])
    first = names[0]
    assert [r["bundles"] for r in groups["rollout_replicas"]][:2] == [[[first, 0], [first, 1]], [[first, 2], [first, 3]]]
    assert groups["rollout_replicas"][4]["bundles"] == [[names[1], 0], [names[1], 1]]
    assert groups["trainer"]["bundles"] == [[n, k] for n in names for k in range(8)]
    assert json.loads(files["launch/vllm/engine_args.json"])["enable_sleep_mode"] is True


def test_vllm_engine_args_follow_the_plan() -> None:
    resolved = load_example("moe-235b-h800x512")
    plan = example_plan(resolved, "moe-235b-h800x512")
    files = render_launch(resolved, plan)
    args = json.loads(files["launch/vllm/engine_args.json"])
    assert args["model"] == "Qwen/Qwen3-235B-A22B"
    assert args["tensor_parallel_size"] == plan.rollout.tp
    assert args.get("data_parallel_size", 1) == max(1, plan.rollout.ep // plan.rollout.tp)
    assert bool(args.get("enable_expert_parallel", False)) == (plan.rollout.ep > 1)
    assert args["max_model_len"] == 2048 + 32768
    # vLLM's max_num_seqs is one data-parallel rank's; the plan's slots are the replica's
    dp = plan.rollout.accelerators_per_replica // plan.rollout.tp
    assert args["max_num_seqs"] == -(-plan.rollout.max_num_seqs // dp) and args["dtype"] == "bfloat16"
    assert dp > 1 and plan.rollout.ep == plan.rollout.accelerators_per_replica  # the 235B example's engines
    # the experts' all-to-all the cost model prices (routed copies only), not vLLM's all-gather default
    assert args["all2all_backend"] == "deepep_low_latency"
    assert "all2all_backend deepep_low_latency" in files["launch/NOTES.txt"]
    one_rank = dataclasses.replace(plan, rollout=dataclasses.replace(
        plan.rollout, tp=16, ep=16, accelerators_per_replica=16, replicas=plan.rollout.accelerators // 16))
    assert "all2all_backend" not in json.loads(render_launch(resolved, one_rank)["launch/vllm/engine_args.json"])
    # EPLB stays off (an RL weight update addresses logical experts), and the notes say why and what is assumed
    assert "enable_eplb" not in args
    assert "enable_eplb) is left off" in files["launch/NOTES.txt"] and "moe_imbalance_factor" in files["launch/NOTES.txt"]
    dense = render_launch(load_example("dense-32b-h800x128"), example_plan(load_example("dense-32b-h800x128"),
                                                                           "dense-32b-h800x128"))
    assert "enable_eplb" not in dense["launch/NOTES.txt"]
    argv = shlex.split(files["launch/vllm/serve.args"])
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-235B-A22B"]
    assert argv[argv.index("--max-model-len") + 1] == "34816"


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: dataclasses.replace(p, rollout=dataclasses.replace(p.rollout, replicas=23)),
     r"replicas \(23\) x accelerators_per_replica \(2\) = 46 != accelerators \(48\)"),
    (lambda p: dataclasses.replace(p, train=dataclasses.replace(p.train, dp=4)),
     r"tp\(2\) \* pp\(1\) \* cp\(1\) \* dp\(4\) = 8 != accelerators \(16\)"),
    (lambda p: dataclasses.replace(p, rollout=dataclasses.replace(p.rollout, accelerators=40, replicas=20),
                                   train=dataclasses.replace(p.train, accelerators=24, tp=3, dp=8)),
     r"tp \(3\) does not divide num_attention_heads \(32\)"),
    (lambda p: dataclasses.replace(p, train=dataclasses.replace(p.train, pp=16, tp=1, dp=1)),
     r"pp \(16\): Megatron cannot split 36 layers over 16 stages"),
    (lambda p: dataclasses.replace(p, rollout=dataclasses.replace(p.rollout, max_model_len=4096)),
     r"max_model_len \(4096\) < prompt cap \+ response cap \(2048 \+ 16384 = 18432\)"),
    (lambda p: dataclasses.replace(p, rollout=dataclasses.replace(p.rollout, ep=2)),
     r"ep = 2 but qwen3-8b has no experts"),
    (lambda p: dataclasses.replace(p, rollout=dataclasses.replace(p.rollout, accelerators=64, replicas=32)),
     r"rollout \(64\) \+ train \(16\) = 80 > the cluster's 64 accelerators"),
])
def test_inconsistent_plans_are_refused_with_the_arithmetic(change, message: str) -> None:
    resolved = load_example("dense-8b-h800x64")
    plan = example_plan(resolved, "dense-8b-h800x64")
    # a fixed, consistent baseline placement, so the planted inconsistencies have known arithmetic
    baseline = dataclasses.replace(
        plan, colocated=False,
        rollout=dataclasses.replace(plan.rollout, accelerators=48, tp=2, ep=1, replicas=24, accelerators_per_replica=2),
        train=dataclasses.replace(plan.train, accelerators=16, tp=2, pp=1, cp=1, ep=1, dp=8))
    build_context(resolved, baseline)
    with pytest.raises(LoweringError, match=message):
        build_context(resolved, change(baseline))


def test_experts_fold_into_the_tensor_parallel_ranks_as_the_search_plans_them() -> None:
    # The search lets ep divide tp*dp*cp (experts whole on each rank, as the cost model shards them); Megatron then
    # needs expert_tensor_parallel_size 1, or it would require ep to divide dp*cp
    resolved = load_example("moe-235b-h800x512")
    plan = example_plan(resolved, "moe-235b-h800x512")
    train = dataclasses.replace(plan.train, tp=2, pp=4, dp=1, cp=8, ep=16, accelerators=64)
    rollout = dataclasses.replace(plan.rollout, tp=4, ep=32, accelerators_per_replica=32, accelerators=448, replicas=14)
    folded = dataclasses.replace(plan, colocated=False, train=train, rollout=rollout)
    config = json.loads(render_launch(resolved, folded)["launch/megatron/config.json"])
    assert config["model_parallel"]["expert_model_parallel_size"] == 16
    assert config["model_parallel"]["expert_tensor_parallel_size"] == 1
    with pytest.raises(LoweringError, match=r"ep \(32\) must divide tp \* dp \* cp = 2 \* 1 \* 8 = 16"):
        build_context(resolved, dataclasses.replace(folded, train=dataclasses.replace(train, ep=32)))


def test_write_is_atomic_and_replaces_stale_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resolved = load_example("dense-8b-h800x64")
    plan = example_plan(resolved, "dense-8b-h800x64")
    written = write_launch_artifacts(resolved, plan, tmp_path)
    assert written == sorted(tmp_path / rel for rel in render_launch(resolved, plan))
    assert (tmp_path / "launch/launch.sh").stat().st_mode & 0o111
    before = {p: p.read_bytes() for p in written}
    (tmp_path / "launch/stale.txt").write_text("from an older lowering")

    real_replace = render_module.os.replace

    def fail_on_swap(src, dst):
        if Path(dst) == tmp_path / "launch":
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(render_module.os, "replace", fail_on_swap)
    with pytest.raises(OSError, match="disk full"):
        write_launch_artifacts(resolved, plan, tmp_path)
    monkeypatch.undo()
    # The failed write left the previous launch/ exactly as it was, and no staging directory behind.
    assert {p: p.read_bytes() for p in written} == before
    assert (tmp_path / "launch/stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch"]

    write_launch_artifacts(resolved, plan, tmp_path)
    assert not (tmp_path / "launch/stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch"]
