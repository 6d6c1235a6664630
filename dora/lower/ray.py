"""Ray artifacts: the job submission body (``job.json``) and the placement groups (``placement_groups.json``).

The runtime driver creates one placement group per rollout replica and one for the trainer, in the order listed,
from ``placement_groups.json``; the Jobs API body mirrors what ``launch.sh`` passes to ``ray job submit``.
"""

from __future__ import annotations

import posixpath
import shlex
from typing import Any

from dora import __version__
from dora.lower.errors import LoweringError
from dora.spec.loader import ResolvedSpec, slug
from planner.plan import Plan

CPUS_PER_GPU_BUNDLE = 4
"""CPU cores reserved next to each GPU: a vLLM worker or a Megatron rank keeps ~2 cores busy (engine loop,
detokenisation, data loading); 4 per GPU fits any 8-GPU server with >= 32 cores and leaves the rest to Ray."""

ENTRYPOINT_ARGV = ("python", "-m", "dora.runtime.driver", "--config", "launch/runtime.json")
"""What the Ray job runs, relative to the plan directory (the job's working directory)."""

LOCAL_RAY_ADDRESS = "http://127.0.0.1:8265"
"""Dashboard address of a local `ray start --head`, used when the spec's backend is `local`."""


def _check_sizes(resolved: ResolvedSpec, plan: Plan) -> None:
    r, t = plan.rollout, plan.train
    total = resolved.spec.total_accelerators
    if r.replicas * r.accelerators_per_replica != r.accelerators:
        raise LoweringError(
            f"plan.rollout: replicas ({r.replicas}) x accelerators_per_replica ({r.accelerators_per_replica}) = "
            f"{r.replicas * r.accelerators_per_replica} != accelerators ({r.accelerators})")
    if plan.colocated:
        if r.accelerators != t.accelerators or r.accelerators > total:
            raise LoweringError(
                f"colocated plan: rollout ({r.accelerators}) and train ({t.accelerators}) accelerators must be the "
                f"same set, at most the cluster's {total}")
    elif r.accelerators + t.accelerators > total:
        raise LoweringError(
            f"disaggregated plan: rollout ({r.accelerators}) + train ({t.accelerators}) = "
            f"{r.accelerators + t.accelerators} > the cluster's {total} accelerators")


def _bundle(accelerator: str) -> dict[str, int]:
    return {"CPU": 1} if accelerator == "cpu" else {"CPU": CPUS_PER_GPU_BUNDLE, "GPU": 1}


def _node_groups(prefix: str, role: str, count: int, per_node: int, bundle: dict[str, int],
                 groups: list[dict[str, Any]]) -> list[list[Any]]:
    """Append ``count`` bundles to ``groups`` as STRICT_PACK groups of at most one node each (named ``prefix``, or
    ``prefix-node-NNN`` when it takes several); return ``[group name, bundle index]`` of each accelerator in order.
    Consecutive accelerators share a node, so a TP group a plan keeps inside a node stays there: one PACK group
    spanning nodes would not, because Ray places identical bundles in no fixed order (its scheduler sorts them with
    an unstable sort, and fills each node in that order)."""
    chunks = [min(per_node, count - first) for first in range(0, count, per_node)]
    slots: list[list[Any]] = []
    for j, size in enumerate(chunks):
        name = prefix if len(chunks) == 1 else f"{prefix}-node-{j:03d}"
        groups.append({"name": name, "role": role, "bundles": [bundle] * size, "strategy": "STRICT_PACK"})
        slots.extend([name, k] for k in range(size))
    return slots


def placement_groups(resolved: ResolvedSpec, plan: Plan) -> dict[str, Any]:
    """Placement groups matching the plan, none larger than a node (``_node_groups``): per rollout replica and for
    the trainer (disaggregated), or per node, whose bundles the replicas split and the trainer time-shares
    (colocated). Each replica and the trainer get their ``[placement group, bundle index]`` per rank, in rank
    order."""
    _check_sizes(resolved, plan)
    cluster = resolved.spec.cluster
    name = slug(resolved.spec.name)
    bundle = _bundle(cluster.accelerator)
    per_node = cluster.accelerators_per_node
    r, t = plan.rollout, plan.train
    width = max(3, len(str(r.replicas - 1)))
    groups: list[dict[str, Any]] = []
    replicas: list[dict[str, Any]] = []
    why = {"strict_pack": f"every group fits one node ({per_node} accelerators): a rank's bundle is on the node "
                          "its place in the list says, and a TP group kept inside a node stays on its links"}
    if plan.colocated:
        shared = _node_groups(f"dora-{name}-shared", "shared", r.accelerators, per_node, bundle, groups)
        why["shared"] = "colocated: rollout replicas split the node groups' bundles and the trainer time-shares all"
        for i in range(r.replicas):
            first = i * r.accelerators_per_replica
            replicas.append({"replica": i, "bundles": shared[first:first + r.accelerators_per_replica]})
        trainer = {"bundles": shared[:t.accelerators]}
    else:
        for i in range(r.replicas):
            replicas.append({"replica": i, "bundles": _node_groups(
                f"dora-{name}-rollout-{i:0{width}d}", "rollout", r.accelerators_per_replica, per_node, bundle,
                groups)})
        trainer = {"bundles": _node_groups(f"dora-{name}-train", "train", t.accelerators, per_node, bundle, groups)}
    return {"colocated": plan.colocated, "accelerator": cluster.accelerator, "placement_groups": groups,
            "rollout_replicas": replicas, "trainer": trainer, "strategy_why": why}


def entrypoint() -> str:
    return shlex.join(ENTRYPOINT_ARGV)


def runtime_env(resolved: ResolvedSpec) -> dict[str, Any]:
    """The job's runtime_env: the plan directory is uploaded as working_dir, without the run outputs."""
    out = posixpath.normpath(resolved.output_dir)  # as written, `./runs/x` or `runs/y/../x` would exclude nothing
    # nothing to exclude when the outputs are not under working_dir (not uploaded), or are working_dir itself
    excludes = [] if out in (".", "..") or out.startswith(("/", "../")) else [f"/{_glob_escaped(out)}/"]
    return {"working_dir": ".", "excludes": excludes, "env_vars": {"PYTHONUNBUFFERED": "1"}}


def _glob_escaped(path: str) -> str:
    """``path`` as a literal gitignore pattern (Ray's ``excludes``): ``[``, ``*``, ``?`` and ``\\`` escaped."""
    return "".join("\\" + c if c in "[]*?\\" else c for c in path)


def job_metadata(resolved: ResolvedSpec, plan: Plan) -> dict[str, str]:
    """Ray job metadata (string to string): what a `ray job list` reader needs to find the plan again."""
    return {"dora_version": __version__, "dora_spec_name": resolved.spec.name,
            "dora_spec_hash": resolved.spec_hash, "dora_mode": plan.mode,
            "dora_max_version_lag": str(plan.max_version_lag)}


def ray_address(resolved: ResolvedSpec) -> str:
    rt = resolved.spec.runtime
    return rt.address if rt.backend == "ray-cluster" and rt.address else LOCAL_RAY_ADDRESS


def job_submission(resolved: ResolvedSpec, plan: Plan) -> dict[str, Any]:
    """The Ray Jobs API submission body (``POST /api/jobs/``). The driver itself needs one CPU and no GPU: the
    engines run in actors inside the placement groups."""
    return {"entrypoint": entrypoint(), "runtime_env": runtime_env(resolved),
            "metadata": job_metadata(resolved, plan), "entrypoint_num_cpus": 1, "entrypoint_num_gpus": 0}
