"""Continuous-batching rollout engine in torch on CPU (the role vLLM plays on GPU).

Memory: one preallocated ``KVCache`` of ``max_num_seqs`` slots x
``max_model_len`` positions, shared by every hosted version (a slot belongs to
one sequence, a sequence to one version). Active sequences are kept compacted
in slots ``0..n-1`` (a finished sequence's slot is filled by moving the last
one), so with a single hosted version the decode reads the cache as a view.

One ``step()``:

1. admit waiting requests FIFO while fewer than ``max_num_seqs`` are active;
   imported requests bring their KV cache, the others are prefilled (one
   right-padded row per request, batched per version) and sample their first
   response token;
2. every sequence that was already active decodes one token: one batched
   forward per hosted version that has such sequences;
3. sequences that sampled EOS, reached ``max_new_tokens`` or ``max_model_len``
   leave, and are returned as ``FinishedTrajectory``.

So each active sequence gains exactly one token per step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

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
from dora.runtime.engines.sampling import noise_key, sample_keyed
from dora.runtime.engines.tiny_model import (
    KVCache,
    StackedVersions,
    TinyModelConfig,
    TinyTransformer,
    decode_versions,
    model_from_weights,
    stack_versions,
)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Engine limits. Sampling seeds are per request (``GenerationRequest.seed``)."""

    model: TinyModelConfig
    engine: Literal["torch", "vllm"] = "torch"
    """Which engine a rollout worker builds (``actors.rollout_engine``): this one, or vLLM's
    (``vllm_rollout.VLLMRolloutEngine``, which reads the fields below but ``decode_ingest_max_tokens``)."""
    eos_token_id: int
    max_num_seqs: int = 32
    """Cache slots = most sequences decoded together."""
    max_model_len: int = 256
    """Prompt plus response tokens per sequence (cache positions per slot)."""
    num_threads: int = 1
    """``torch.set_num_threads`` for this process (the engine owns its process in a Ray actor)."""
    decode_ingest_max_tokens: int = 8
    """A sequence admitted with at most this many uncached tokens (a short prompt) joins the decode batch at
    once and ingests them one per step, teacher-forced, instead of getting a prefill forward of its own
    (chunked prefill with chunk 1). On CPU at this size a forward costs ~1.5 ms however few rows it has,
    so a 4-token prompt costs 3 extra rows of a decode step (~0.05 ms) instead of a whole extra forward;
    measured: prefill was 22% of the engine thread in streaming. Longer ones (a resumed partial rollout)
    are prefilled in one forward. 0 turns it off -- as modes that resume in-flight requests on new weights must
    (partial rollout): a request interrupted mid-ingest has no token yet and would start on the new version."""


@dataclass(kw_only=True)
class _Sequence:
    """Mutable per-request state inside the engine."""

    request: GenerationRequest
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    cached_len: int = 0
    """Tokens whose keys/values are in the cache (prompt + response minus the last sampled one)."""
    slot: int = -1
    kv: torch.Tensor | None = None
    """Cache carried by an imported request until it gets a slot."""
    noise_key: int = field(init=False)
    """``noise_key(request.seed)``, hashed once here rather than once per sampled token."""

    def __post_init__(self) -> None:
        self.noise_key = noise_key(self.request.seed)

    def next_input(self) -> int:
        """The token fed at position ``cached_len``: a prompt/prefix token while ingesting, else the last sampled."""
        prompt = self.request.prompt_ids
        i = self.cached_len
        return prompt[i] if i < len(prompt) else self.response[i - len(prompt)]

    def ingesting(self) -> bool:
        """Still feeding known tokens (the next forward's output is not sampled)?"""
        return self.cached_len + 1 < len(self.request.prompt_ids) + len(self.response)

    def record(self, token: int, logprob: float) -> None:
        self.response.append(token)
        self.logprobs.append(logprob)
        extend_spans(self.spans, self.request.version, 1)

    def partial(self) -> PartialTrajectory:
        return partial_trajectory(self.request, self.response, self.logprobs, self.spans)


class TorchRolloutEngine:
    """Implements ``RolloutEngine`` (see ``base.py``) with ``TinyTransformer``."""

    def __init__(self, config: RolloutConfig) -> None:
        torch.set_num_threads(config.num_threads)
        self.config = config
        self._models: dict[int, TinyTransformer] = {}
        self._stacks: dict[tuple[int, ...], StackedVersions] = {}
        self._cache = KVCache(config.model, num_slots=config.max_num_seqs, max_len=config.max_model_len)
        self._slots: list[_Sequence] = []
        self._waiting: deque[_Sequence] = deque()
        self._counters = dict.fromkeys(
            ("steps", "decode_forwards", "decoded_tokens", "prefill_tokens", "generated_tokens",
             "slot_steps_busy", "finished", "aborted"), 0)
        self._decode_time_s = 0.0
        self._prefill_time_s = 0.0
        self._shape = _IDLE

    # ----- versions -------------------------------------------------------------------------
    def load_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.install_weights(version, self.stage_weights(version, weights))

    def stage_weights(self, version: int, weights: dict[str, torch.Tensor]) -> TinyTransformer:
        return model_from_weights(self.config.model, weights)

    def install_weights(self, version: int, staged: object) -> None:
        if not isinstance(staged, TinyTransformer) or staged.config != self.config.model:
            raise TypeError(f"install_weights(v{version}): expected stage_weights' model, got {type(staged).__name__}")
        busy = [s.request.request_id for s in (*self._slots, *self._waiting) if s.request.version == version]
        if busy and version in self._models:
            raise RuntimeError(f"cannot replace version {version}'s weights: {len(busy)} requests use it "
                               f"(e.g. {busy[0]!r}) and would go on under other weights with their old KV cache")
        self._models[version] = staged
        self._stacks.clear()

    def _stacked(self, versions: tuple[int, ...]) -> StackedVersions:
        """The hosted versions' weights stacked for a one-pass multi-version decode (rebuilt when they change)."""
        stacked = self._stacks.get(versions)
        if stacked is None:
            self._stacks.clear()
            stacked = self._stacks[versions] = stack_versions([self._models[v] for v in versions])
        return stacked

    def drop_version(self, version: int) -> None:
        busy = [s.request.request_id for s in (*self._slots, *self._waiting) if s.request.version == version]
        if busy:
            raise RuntimeError(f"cannot drop version {version}: {len(busy)} requests use it (e.g. {busy[0]!r})")
        self._models.pop(version, None)
        self._stacks.clear()

    def hosted_versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._models))

    # ----- requests -------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        self._check_request(request)
        seq = _Sequence(request=request)
        if request.prefix is not None:
            seq.response = list(request.prefix.response_ids)
            seq.logprobs = list(request.prefix.behaviour_logprobs)
            seq.spans = list(request.prefix.version_spans)
        self._waiting.append(seq)

    def _check_request(self, request: GenerationRequest) -> None:
        if request.version not in self._models:
            raise ValueError(
                f"request {request.request_id!r} wants version {request.version}, engine hosts "
                f"{self.hosted_versions()}; call load_weights first"
            )
        check_request(request, 0 if request.prefix is None else len(request.prefix.response_ids),
                      self.config.max_model_len)

    def abort(self, request_id: str) -> PartialTrajectory | None:
        seq = self._remove(request_id)
        if seq is None:
            return None
        self._counters["aborted"] += 1
        return seq.partial()

    def export_request(self, request_id: str) -> MigratingRequest:
        for live in self._slots:
            if live.request.request_id == request_id:
                # Mid-ingest (prompt not fully cached yet): the target re-ingests it, nothing to carry.
                kv = None if live.ingesting() else self._cache.read_slot(live.slot, live.cached_len)
                break
        else:
            kv = None
        seq = self._remove(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not in this engine")
        if seq.kv is not None:  # imported but never admitted here: pass its cache along
            kv = seq.kv
        return MigratingRequest(
            request=seq.request,
            response_ids=tuple(seq.response),
            behaviour_logprobs=tuple(seq.logprobs),
            version_spans=tuple(seq.spans),
            kv_cache=kv,
            next_token=seq.next_input() if kv is not None else None,
        )

    def import_request(self, migrating: MigratingRequest) -> None:
        self._check_request(migrating.request)
        seq = _Sequence(
            request=migrating.request,
            response=list(migrating.response_ids),
            logprobs=list(migrating.behaviour_logprobs),
            spans=list(migrating.version_spans),
            kv=migrating.kv_cache,
        )
        if migrating.kv_cache is not None:
            seq.cached_len = migrating.kv_cache.shape[3]
        self._waiting.append(seq)

    def _remove(self, request_id: str) -> _Sequence | None:
        for seq in self._waiting:
            if seq.request.request_id == request_id:
                self._waiting.remove(seq)
                return seq
        for seq in self._slots:
            if seq.request.request_id == request_id:
                self._release(seq)
                return seq
        return None

    def _release(self, seq: _Sequence) -> None:
        """Free ``seq``'s slot, moving the last active sequence into it to stay compacted."""
        last = self._slots[-1]
        if last is not seq:
            self._cache.move_slot(last.slot, seq.slot, last.cached_len)
            self._slots[seq.slot] = last
            last.slot = seq.slot
        self._slots.pop()
        seq.slot = -1

    def num_active(self) -> int:
        return len(self._slots)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def active_request_ids(self) -> tuple[str, ...]:
        return tuple(s.request.request_id for s in self._slots)

    def in_flight_requests(self) -> list[GenerationRequest]:
        """Requests holding a slot (slot order) then those waiting (arrival order)."""
        return [s.request for s in (*self._slots, *self._waiting)]

    # ----- the engine loop --------------------------------------------------------------------
    def step(self) -> list[FinishedTrajectory]:
        decoding = list(self._slots)
        admitted = self._admit()
        if not decoding and not admitted:
            self._shape = _IDLE
            return []
        self._counters["steps"] += 1
        self._counters["slot_steps_busy"] += len(self._slots)
        to_prefill = []
        for s in admitted:
            if s.kv is not None:  # imported with its cache: it decodes like a resident sequence
                self._cache.write_slot(s.slot, s.kv)
                s.kv = None
                decoding.append(s)
            elif len(s.request.prompt_ids) + len(s.response) - s.cached_len <= self.config.decode_ingest_max_tokens:
                decoding.append(s)  # ingests its prompt through the decode batch
            else:
                to_prefill.append(s)
        prefill_tokens = sum(len(s.request.prompt_ids) + len(s.response) for s in to_prefill)
        if to_prefill:
            start = time.perf_counter()
            for version, group in _by_version(to_prefill).items():
                self._prefill(self._models[version], group)
            self._prefill_time_s += time.perf_counter() - start
        sampled = to_prefill
        self._shape = StepShape(
            decode_rows=len(decoding), context_tokens=sum(s.cached_len for s in decoding),
            versions=len({s.request.version for s in decoding}),
            prefill_tokens=prefill_tokens,
        )
        if decoding:
            start = time.perf_counter()
            sampled = self._decode(sorted(decoding, key=lambda s: s.slot)) + to_prefill
            self._decode_time_s += time.perf_counter() - start
        return self._collect_finished(sampled)

    def _admit(self) -> list[_Sequence]:
        admitted = []
        while self._waiting and len(self._slots) < self.config.max_num_seqs:
            seq = self._waiting.popleft()
            seq.slot = len(self._slots)
            self._slots.append(seq)
            admitted.append(seq)
        return admitted

    @torch.no_grad()
    def _prefill(self, model: TinyTransformer, group: list[_Sequence]) -> None:
        rows = [list(s.request.prompt_ids) + s.response for s in group]
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)
        segments = torch.full((len(rows), width), -1, dtype=torch.int64)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
            segments[i, : len(row)] = 0
        positions = torch.arange(width).expand(len(rows), width)
        logits = model.forward_rows(tokens, positions, segments, cache=self._cache, cache_slots=[s.slot for s in group])
        last = torch.tensor([len(r) - 1 for r in rows])
        self._sample(group, logits[torch.arange(len(rows)), last])
        for s, row in zip(group, rows, strict=True):
            s.cached_len = len(row)
        self._counters["prefill_tokens"] += sum(len(r) for r in rows)

    @torch.inference_mode()  # cheaper per op than no_grad (no view or version tracking); nothing here is kept
    def _decode(self, group: list[_Sequence]) -> list[_Sequence]:
        """One decode step for every resident sequence -- one batched pass however many versions they use.

        Rows still ingesting known tokens only fill the cache; the others sample a token. Returns those.
        """
        tokens = torch.tensor([s.next_input() for s in group])
        positions = torch.tensor([s.cached_len for s in group])
        slots = torch.tensor([s.slot for s in group])
        versions = sorted({s.request.version for s in group})
        if len(versions) == 1:
            logits = self._models[versions[0]].decode(tokens, positions, self._cache, slots)
        else:
            index = {v: i for i, v in enumerate(versions)}
            version_index = torch.tensor([index[s.request.version] for s in group])
            logits = decode_versions(self.config.model, self._stacked(tuple(versions)), version_index, tokens,
                                     positions, self._cache, slots)
        # A row samples once its last known token went in; rows still ingesting only filled the cache.
        keep = [i for i, s in enumerate(group) if not s.ingesting()]
        for s in group:
            s.cached_len += 1
        ingested = len(group) - len(keep)
        self._counters["decode_forwards"] += 1
        self._counters["decoded_tokens"] += len(keep)
        self._counters["prefill_tokens"] += ingested
        if not ingested:
            self._sample(group, logits)
            return group
        sampled = [group[i] for i in keep]
        if sampled:
            self._sample(sampled, logits[torch.tensor(keep)])
        return sampled

    def _sample(self, group: list[_Sequence], logits: torch.Tensor) -> None:
        too_early = [i for i, s in enumerate(group) if len(s.response) < s.request.min_new_tokens]
        if too_early:
            logits[torch.tensor(too_early), self.config.eos_token_id] = float("-inf")
        temps = [s.request.temperature for s in group]
        keys = torch.tensor([s.noise_key for s in group], dtype=torch.int64)
        positions = torch.tensor([len(s.response) for s in group])
        tokens, logprobs = sample_keyed(logits, torch.tensor(temps, dtype=torch.float32), keys, positions,
                                        any_greedy=any(t <= 0 for t in temps))
        for s, tok, lp in zip(group, tokens.tolist(), logprobs.tolist(), strict=True):
            s.record(tok, lp)
        self._counters["generated_tokens"] += len(group)

    def _collect_finished(self, stepped: list[_Sequence]) -> list[FinishedTrajectory]:
        done = []
        for s in stepped:
            reason = self._finish_reason(s)
            if reason is None:
                continue
            self._release(s)
            self._counters["finished"] += 1
            p = s.partial()
            done.append(FinishedTrajectory(
                request_id=p.request_id, prompt_ids=p.prompt_ids, response_ids=p.response_ids,
                behaviour_logprobs=p.behaviour_logprobs, version_spans=p.version_spans, finish_reason=reason,
            ))
        return done

    def _finish_reason(self, s: _Sequence) -> FinishReason | None:
        if s.response[-1] == self.config.eos_token_id:
            return "stop"
        # The last sampled token still needs a cache position to be decoded from.
        if len(s.response) >= s.request.max_new_tokens or s.cached_len + 1 >= self.config.max_model_len:
            return "length"
        return None

    def last_step_shape(self) -> StepShape:
        return self._shape

    def stats(self) -> RolloutStats:
        return RolloutStats(
            num_active=len(self._slots),
            num_waiting=len(self._waiting),
            hosted_versions=self.hosted_versions(),
            decode_time_s=self._decode_time_s,
            prefill_time_s=self._prefill_time_s,
            **self._counters,
        )


_IDLE = StepShape(decode_rows=0, context_tokens=0, versions=0, prefill_tokens=0)


def _by_version(seqs: list[_Sequence]) -> dict[int, list[_Sequence]]:
    groups: dict[int, list[_Sequence]] = {}
    for s in seqs:
        groups.setdefault(s.request.version, []).append(s)
    return groups
