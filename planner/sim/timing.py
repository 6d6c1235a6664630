"""The timing interface the simulator needs, and a linear implementation with hand-checkable numbers.

Any object with these members works (the cost-model adapter in ``planner.sim.costmodel`` builds one
from architecture, accelerator, placement and calibration):

    decode_step_s(batch_size, total_context_tokens) -> s   one decode step of one engine replica
    decode_step_ranks_s(batch_size, busiest_batch, busiest_context_tokens) -> s
                                                            the same for a replica of attention data-parallel ranks
                                                            (the simulator's ``attention_dp`` > 1), whose busiest
                                                            rank decodes that batch and context
    prefill_s(num_tokens) -> s                              prefill of num_tokens on one replica
    train_step_s(num_tokens, sum_sq_seq_len, num_seqs) -> s one optimizer step over a batch
    weight_publish_s     trainer-side gather/reshard of a new version (trainer busy), s
    weight_load_trainer_s  one replica loading a version from the trainer, s
    weight_load_peer_s   one replica loading a version from a peer replica, s
    kv_migration_s_per_token  KV-cache transfer time per context token moved between replicas, s
    weight_bytes_per_group  bytes of one policy version on one replica (for the extra-memory metric)
    rollout_contention   factor on a decode step while the trainer runs (1: separate devices)
    train_contention     factor on a training step started while rollout runs (1: separate devices)
    engine_contention    factor on a decode step while another replica decodes too (1: separate devices)
    prompt_ingest_max_tokens  prompts up to this long are fed through the decode batch, one token per step
    swap_fixed_s         colocated streaming: one replica's pause or resume when it moves to or from host memory, s
    swap_s_per_version   moving one hosted version's weights between device and host memory, s (each way)
    swap_s_per_token     the same for one context token of KV cache, s
    report_round_trip_s  from a rollout worker's poll reply to the admissions it makes reaching the engine, s (0: the
                         policy hears of every finish at once; else finishes reach it in batches, as the runtime's
                         polls return them, ``planner.policies.poll_batching``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StepTiming(Protocol):
    # Read-only properties: implementations are frozen dataclasses, whose fields mypy treats as read-only.
    @property
    def weight_publish_s(self) -> float: ...

    @property
    def weight_load_trainer_s(self) -> float: ...

    @property
    def weight_load_peer_s(self) -> float: ...

    @property
    def kv_migration_s_per_token(self) -> float: ...

    @property
    def weight_bytes_per_group(self) -> float: ...

    @property
    def extra_version_step_s(self) -> float:
        """Added to a decode step for each hosted version with running requests beyond the first (multi-version)."""
        ...

    @property
    def rollout_contention(self) -> float: ...

    @property
    def train_contention(self) -> float: ...

    @property
    def engine_contention(self) -> float: ...

    @property
    def prompt_ingest_max_tokens(self) -> int: ...

    @property
    def swap_fixed_s(self) -> float: ...

    @property
    def swap_s_per_version(self) -> float: ...

    @property
    def swap_s_per_token(self) -> float: ...

    @property
    def report_round_trip_s(self) -> float: ...

    def decode_step_s(self, batch_size: int, total_context_tokens: float) -> float: ...

    def decode_step_ranks_s(self, batch_size: int, busiest_batch: int, busiest_context_tokens: float) -> float:
        """One decode step of a replica of attention data-parallel ranks decoding ``batch_size`` sequences in all, in
        lockstep: ``busiest_batch`` of them on its busiest rank, and ``busiest_context_tokens`` on the rank that holds
        the most context (called only by simulations with ``attention_dp`` > 1)."""
        ...

    def prefill_s(self, num_tokens: int, sequences: int = 1) -> float:
        """The prefill of ``num_tokens`` tokens, of ``sequences`` sequences (which an engine with attention data
        parallelism spreads over its ranks)."""
        ...

    def train_step_s(self, num_tokens: int, sum_sq_seq_len: float, num_seqs: int) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearTiming:
    """Affine step times, for tests and back-of-envelope runs.

    decode_step_s = decode_base_s + decode_per_seq_s * B + decode_per_context_token_s * C
    prefill_s     = prefill_per_token_s * tokens
    train_step_s  = train_base_s + train_per_token_s * tokens
    With every ``per_*`` at 0 each decode step takes ``decode_base_s``: a response of L tokens
    takes exactly ``L * decode_base_s`` regardless of batch.
    """

    decode_base_s: float
    decode_per_seq_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    prefill_per_token_s: float = 0.0
    train_base_s: float = 0.0
    train_per_token_s: float = 0.0
    weight_publish_s: float = 0.0
    weight_load_trainer_s: float = 0.0
    weight_load_peer_s: float = 0.0
    kv_migration_s_per_token: float = 0.0
    weight_bytes_per_group: float = 0.0
    extra_version_step_s: float | None = None
    """None: ``decode_base_s`` (each extra hosted version costs a step's fixed part)."""
    rollout_contention: float = 1.0
    train_contention: float = 1.0
    engine_contention: float = 1.0
    prompt_ingest_max_tokens: int = 0
    swap_fixed_s: float = 0.0
    swap_s_per_version: float = 0.0
    swap_s_per_token: float = 0.0
    report_round_trip_s: float = 0.0

    def __post_init__(self) -> None:
        if self.decode_base_s <= 0:
            raise ValueError(f"decode_base_s must be > 0, got {self.decode_base_s}")
        if self.extra_version_step_s is None:
            object.__setattr__(self, "extra_version_step_s", self.decode_base_s)

    def decode_step_s(self, batch_size: int, total_context_tokens: float) -> float:
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch_size
            + self.decode_per_context_token_s * total_context_tokens
        )

    def decode_step_ranks_s(self, batch_size: int, busiest_batch: int, busiest_context_tokens: float) -> float:
        """The busiest rank's step: ``decode_step_s`` of its batch and context."""
        return self.decode_step_s(busiest_batch, busiest_context_tokens)

    def prefill_s(self, num_tokens: int, sequences: int = 1) -> float:
        return self.prefill_per_token_s * num_tokens

    def train_step_s(self, num_tokens: int, sum_sq_seq_len: float, num_seqs: int) -> float:
        return self.train_base_s + self.train_per_token_s * num_tokens
