"""vLLM engine arguments for one rollout replica: as ``EngineArgs`` keyword arguments and as `vllm serve` argv.

Every replica gets the same engine arguments, so one file serves all of them: placement differs per replica
(``placement_groups.json``), and sampling randomness is made per request by the runtime (a seed derived from the
spec seed and the trajectory id in each request's sampling parameters), so identical engine seeds do not make
replicas produce identical samples.

Flag names follow vLLM's ``EngineArgs`` fields (``--`` + field with ``-``); they are checked against vLLM's own
parser where vLLM is installed and against ``tests/data/vllm_engine_flags.txt`` everywhere else.
"""

from __future__ import annotations

from typing import Any

from dora.lower.errors import LoweringError
from dora.spec.loader import ResolvedSpec
from planner.plan import Plan
from planner.rollout_cost import VLLM_MAX_NUM_BATCHED_TOKENS

VLLM_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}
"""vLLM's --dtype for the spec's dtype; fp8 runs bf16 activations with fp8 weights (``quantization: fp8``)."""


DP_ALL2ALL_BACKEND = "deepep_low_latency"
"""vLLM's expert all-to-all for engines with attention data parallelism: DeepEP's low-latency kernels (vLLM's choice
for decode across nodes; they need DeepEP installed, as vLLM's expert-parallel deployment guide describes)."""


def engine_args(resolved: ResolvedSpec, plan: Plan) -> dict[str, Any]:
    """``vllm.EngineArgs(**engine_args(...))`` for one replica.

    A replica of ``accelerators_per_replica`` GPUs runs ``tp``-way tensor parallelism times
    ``accelerators_per_replica / tp`` attention data-parallel ranks; with experts (``ep > 1``) vLLM's expert
    parallel group is all of them (EP = TP x DP), so the plan's ``ep`` must equal ``accelerators_per_replica``.
    """
    r = plan.rollout
    spec = resolved.spec
    if r.accelerators_per_replica % r.tp:
        raise LoweringError(f"plan.rollout: accelerators_per_replica ({r.accelerators_per_replica}) is not a "
                            f"multiple of tp ({r.tp})")
    dp = r.attention_dp
    if r.ep > 1 and r.ep != r.accelerators_per_replica:
        raise LoweringError(f"plan.rollout: vLLM's expert-parallel size is tp x dp = {r.tp} x {dp} = "
                            f"{r.accelerators_per_replica}, but the plan says ep = {r.ep}")
    if r.ep > 1 and not resolved.arch.is_moe:
        raise LoweringError(f"plan.rollout: ep = {r.ep} but {resolved.arch.name} has no experts")
    caps = spec.workload.prompt_length.max_tokens + spec.workload.response_length.max_tokens
    if r.max_model_len < caps:
        raise LoweringError(f"plan.rollout.max_model_len ({r.max_model_len}) < prompt cap + response cap "
                            f"({spec.workload.prompt_length.max_tokens} + "
                            f"{spec.workload.response_length.max_tokens} = {caps}): long responses would be cut")
    args: dict[str, Any] = {
        "model": spec.model.checkpoint,
        "dtype": VLLM_DTYPE[spec.model.dtype],
        "seed": spec.runtime.seed,
        "tensor_parallel_size": r.tp,
        "max_model_len": r.max_model_len,
        "gpu_memory_utilization": r.gpu_memory_utilization,
        # each attention data-parallel rank is an engine core with a scheduler of its own: the plan's slots are the
        # replica's, over its dp ranks
        "max_num_seqs": -(-r.max_num_seqs // dp),
        # the profiling forward's size, which the planner's memory model assumes (rollout_cost.vllm_reserved_bytes)
        "max_num_batched_tokens": VLLM_MAX_NUM_BATCHED_TOKENS,
    }
    if spec.model.dtype == "fp8":
        args["quantization"] = "fp8"
    if dp > 1:
        args["data_parallel_size"] = dp
        args["data_parallel_backend"] = "ray"  # the replica's ranks live in a Ray placement group
        if r.ep > 1:
            # each token's routed copies go to their experts' devices, the traffic the cost model prices; vLLM's
            # default (allgather_reducescatter) brings every rank's tokens to every device
            args["all2all_backend"] = DP_ALL2ALL_BACKEND
    if r.ep > 1:
        args["enable_expert_parallel"] = True
    if r.accelerators_per_replica > 1:
        args["distributed_executor_backend"] = "ray"
    if plan.colocated:
        # Time-sharing GPUs with the trainer: the engine must release weights and KV cache while training runs.
        args["enable_sleep_mode"] = True
    return args


def serve_argv(args: dict[str, Any]) -> list[str]:
    """``vllm serve MODEL --flag value ...`` for the same arguments (the model is positional; a true boolean is a
    bare flag, as vLLM's BooleanOptionalAction expects). Requires ``args['model']`` to be set."""
    model = args["model"]
    if model is None:
        raise LoweringError("model.checkpoint is not set: vLLM has no weights to serve")
    argv = ["vllm", "serve", model]
    for name in sorted(k for k in args if k != "model"):
        value = args[name]
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv
