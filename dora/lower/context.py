"""The typed context the launch templates render: every value computed, serialised and quoted here.

Templates see only strings (and lists of strings) that are already in their final form: shell words went
through ``shlex.quote``, JSON through ``json.dumps`` with ``ensure_ascii`` (so no raw newline, quote or non-ASCII
character from the spec reaches a file unescaped), and free text placed in comments through ``_one_line``.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from dora import __version__
from dora.lower import megatron, ray, vllm
from dora.lower.runtime import runtime_config
from dora.runtime.config import GPU_ENGINES_MISSING
from dora.spec.loader import ResolvedSpec
from planner.calibration import DEFAULT_CALIBRATION
from planner.plan import Plan


def dump_json(obj: Any) -> str:
    """Deterministic JSON text: sorted keys, 2-space indent, ASCII only, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n"


def dump_json_rows(obj: dict[str, Any]) -> str:
    """Deterministic JSON with one line per list item: readable and diffable for thousands of bundles."""
    lines = ["{"]
    keys = sorted(obj)
    for n, key in enumerate(keys):
        value, comma = obj[key], "," if n < len(keys) - 1 else ""
        head = f"  {json.dumps(key)}: "
        if isinstance(value, list) and value:
            items = [json.dumps(v, sort_keys=True, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
                     for v in value]
            lines += [head + "[", *(f"    {item}," for item in items[:-1]), f"    {items[-1]}", f"  ]{comma}"]
        else:
            lines.append(head + json.dumps(value, sort_keys=True, ensure_ascii=True, allow_nan=False) + comma)
    return "\n".join([*lines, "}"]) + "\n"


def _one_line(text: str) -> str:
    """Free text made safe for a comment or a plain-text line: JSON string escapes (no newline, no control or
    non-ASCII character), without the surrounding quotes."""
    return json.dumps(text, ensure_ascii=True)[1:-1]


@dataclass(frozen=True, kw_only=True)
class ShellLaunch:
    """Pre-quoted pieces of ``launch.sh``."""

    title: str
    """Spec name for the header comment (``_one_line``-escaped)."""
    spec_hash: str
    dora_version: str
    address: str
    """Default Ray dashboard address, shell-quoted (``RAY_ADDRESS`` overrides it)."""
    runtime_env_json: str
    metadata_json: str
    entrypoint_num_cpus: str
    entrypoint: str
    """The entrypoint argv, each word shell-quoted."""
    blocked: tuple[str, ...]
    """Shell-quoted reasons the job must not be submitted as lowered; empty when it may."""


@dataclass(frozen=True, kw_only=True)
class VllmArtifacts:
    engine_args_json: str
    serve_command: str | None
    """`vllm serve ...` as one shell-quoted line; None when there is no checkpoint to serve."""


@dataclass(frozen=True, kw_only=True)
class MegatronArtifacts:
    config_json: str
    args_lines: tuple[str, ...]
    """One shell-quoted Megatron-LM option (flag and value) per line."""


@dataclass(frozen=True, kw_only=True)
class LaunchContext:
    """Everything the launch artifacts contain, ready to place."""

    job_json: str
    placement_groups_json: str
    runtime_json: str
    shell: ShellLaunch
    vllm: VllmArtifacts | None
    """None for the torch rollout engine or the `cpu` accelerator (vLLM needs GPUs)."""
    megatron: MegatronArtifacts | None
    """None for the torch trainer or the `cpu` accelerator."""
    notes: tuple[str, ...]
    """Lines of NOTES.txt, each already single-line and inert."""
    refusals: tuple[str, ...]
    """Why launch.sh will not submit the job, one line each, with the Megatron limitations behind a refusal spelled
    out (what `dora plan --out` warns of); empty when it will."""


def _notes(resolved: ResolvedSpec, plan: Plan, has_vllm: bool, has_megatron: bool,
           blocked: list[str], limits: list[str], megatron_notes: list[str]) -> tuple[str, ...]:
    spec = resolved.spec
    lines = [f"Launch artifacts for spec \"{_one_line(spec.name)}\" (hash {resolved.spec_hash}), "
             f"mode {plan.mode}, max_version_lag {plan.max_version_lag}.",
             "Run launch/launch.sh from anywhere; it submits the job from the plan directory (RAY_ADDRESS "
             "overrides the address)."]
    if not has_vllm and spec.runtime.rollout_engine == "vllm":
        lines.append("No vllm/ files: on 'cpu' dora's rollout workers run vLLM's engine in-process (its CPU backend, "
                     "dora.runtime.engines.vllm_rollout), with the engine arguments they set from runtime.json.")
    elif not has_vllm:
        lines.append(f"No vllm/ files: rollout engine is '{spec.runtime.rollout_engine}' on "
                     f"'{spec.cluster.accelerator}'; vLLM arguments would be meaningless here.")
    if not has_megatron:
        lines.append(f"No megatron/ files: trainer is '{spec.runtime.trainer}' on '{spec.cluster.accelerator}'; "
                     "Megatron configuration would be meaningless here.")
    if has_vllm or has_megatron:
        lines.append("NOT RUNNABLE YET: launch.sh submits dora's driver, which stops before Ray starts: "
                     + GPU_ENGINES_MISSING)
    if has_vllm and plan.colocated and plan.mode == "streaming":
        lines.append("vllm note: colocated streaming suspends every engine for each training step with its in-flight "
                     "requests kept: their KV cache and the engine's weights move to host memory and back (the cost "
                     "model charges both moves over the host link); vLLM's sleep mode (enable_sleep_mode) offloads "
                     "the weights but discards the KV cache, so the GPU rollout worker must move the KV cache itself "
                     "or in-flight requests are recomputed on wake-up.")
    if has_vllm and plan.rollout.attention_dp > 1 and plan.rollout.ep > 1:
        lines.append(f"vllm note: the engines run attention data parallelism with all2all_backend {vllm.DP_ALL2ALL_BACKEND}, "
                     "whose traffic (each token's routed copies to their experts' devices) the cost model prices: "
                     "install DeepEP on the GPU image (vLLM's expert-parallel deployment guide), or expect slower "
                     "steps with vLLM's default, allgather_reducescatter, which brings every rank's tokens to every "
                     "device.")
    if has_vllm and plan.rollout.ep > 1:
        lines.append("vllm note: expert-parallel load balancing (enable_eplb) is left off: EPLB moves experts between "
                     "physical slots while an RL weight update addresses logical experts, so a reload lands on the "
                     "wrong slots unless the rollout worker maps them (prime-rl pull request 3583 shows the "
                     "corruption on vLLM 0.28). The cost model charges the routed load at the calibration's "
                     "moe_imbalance_factor (catalog prior "
                     f"{DEFAULT_CALIBRATION.moe_imbalance_factor:g}; the plan names its calibration) times the "
                     "chance maximum of each device's tokens; if the engines' measured balance is worse, calibrate "
                     "the factor and plan again.")
    lines += [f"BLOCKED: {_one_line(b)}" for b in blocked]
    lines += [f"megatron limitation: {_one_line(m)}" for m in limits]
    lines += [f"megatron note: {_one_line(m)}" for m in megatron_notes]
    lines += [f"plan warning: {_one_line(w)}" for w in plan.warnings]
    return tuple(lines)


def build_context(resolved: ResolvedSpec, plan: Plan) -> LaunchContext:
    """Compute every artifact value for ``plan``; raises LoweringError when the plan is inconsistent."""
    spec = resolved.spec
    on_gpu = spec.cluster.accelerator != "cpu"
    placement = ray.placement_groups(resolved, plan)
    job = ray.job_submission(resolved, plan)
    blocked: list[str] = []
    refusals: list[str] = []  # blocked, with each Megatron limitation behind it spelled out
    vllm_out = megatron_out = None
    limits: list[str] = []
    megatron_notes: list[str] = []
    if on_gpu and spec.runtime.rollout_engine == "vllm":
        args = vllm.engine_args(resolved, plan)
        serve = shlex.join(vllm.serve_argv(args)) if args["model"] is not None else None
        vllm_out = VllmArtifacts(engine_args_json=dump_json(args), serve_command=serve)
    if on_gpu and spec.runtime.trainer == "megatron":
        config = megatron.megatron_config(resolved, plan)
        limits, megatron_notes = config["limitations"], config["notes"]
        megatron_out = MegatronArtifacts(config_json=dump_json(config),
                                         args_lines=tuple(shlex.join(o) for o in megatron.megatron_lm_args(config)))
        if limits:
            blocked.append("megatron-core cannot express this architecture (see megatron/config.json "
                           "'limitations')")
            refusals += [f"megatron-core cannot express this architecture: {m}" for m in limits]
    if (vllm_out or megatron_out) and spec.model.checkpoint is None:
        blocked.append("model.checkpoint is not set: vLLM and Megatron have no weights to load; set it in the "
                       "spec and re-run `dora plan --out`")
        refusals.append(blocked[-1])
    shell = ShellLaunch(
        title=_one_line(spec.name), spec_hash=resolved.spec_hash, dora_version=__version__,
        address=shlex.quote(ray.ray_address(resolved)),
        runtime_env_json=shlex.quote(json.dumps(job["runtime_env"], sort_keys=True, ensure_ascii=True)),
        metadata_json=shlex.quote(json.dumps(job["metadata"], sort_keys=True, ensure_ascii=True)),
        entrypoint_num_cpus=shlex.quote(str(job["entrypoint_num_cpus"])),
        entrypoint=shlex.join(ray.ENTRYPOINT_ARGV),
        blocked=tuple(shlex.quote(f"dora: not submitting: {b}") for b in blocked),
    )
    return LaunchContext(
        job_json=dump_json(job), placement_groups_json=dump_json_rows(placement),
        runtime_json=runtime_config(resolved, plan).to_json(), shell=shell, vllm=vllm_out,
        megatron=megatron_out,
        notes=_notes(resolved, plan, vllm_out is not None, megatron_out is not None, blocked, limits,
                     megatron_notes),
        refusals=tuple(_one_line(f"launch.sh will not submit the job: {b}") for b in refusals),
    )
