"""Torch trainer on CPU (the role Megatron plays on GPU): GRPO on packed sequences, AdamW.

Packing: every training sequence (prompt + response) is placed whole into rows
of ``pack_len`` tokens by first-fit-decreasing; tokens of different sequences in
a row never attend to each other (block-diagonal causal mask, per-sequence
position ids), so the only padding is the unfilled tail of each row and the
cost of a step follows the tokens trained, not ``batch x longest``. The rows are
the unit of work a trainer splits a batch by (microbatches); the tiny model's
own forward (``token_logprobs``) then drops the rows' tails and attends within
each sequence only (``TinyTransformer.forward_sequences``).

One ``train_step``: advantages per GRPO group -> (if ``num_minibatches > 1``) a
no-grad forward for the proximal log-probs -> for each minibatch: forward,
token losses (``grpo.policy_loss``), backward, clip, AdamW step. With one
minibatch the proximal log-probs are that same forward, detached.
The step publishes version ``v + 1``.
"""

from __future__ import annotations

import copy
import hashlib
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from dora.runtime.engines.base import ScoredTrajectory, TrainMetrics
from dora.runtime.engines.sampling import logit_scale
from dora.runtime.engines.tiny_model import (
    TinyModelConfig,
    TinyTransformer,
    export_weights,
    model_from_weights,
)
from dora.runtime.grpo import LossStats, OffPolicyCorrection, group_advantages, policy_loss
from dora.runtime.tasks import LengthSampler, TaskConfig, warmup_examples

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    model: TinyModelConfig
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    off_policy_correction: OffPolicyCorrection = "tis"
    is_weight_cap: float | None = 2.0
    """``C``: truncation of ``pi_prox / mu`` (TIS; optional for decoupled PPO)."""
    ppo_clip_eps: float = 0.2
    num_minibatches: int = 1
    """Optimiser steps per ``train_step`` and epoch; > 1 makes the PPO clip (and proximal forward) matter."""
    ppo_epochs: int = 1
    """Passes over the batch per ``train_step`` (each pass takes ``num_minibatches`` optimiser steps)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (version 0's weights); > 0 adds a reference forward."""
    temperature: float = 1.0
    """Must equal the rollout temperature: log-probs are of ``softmax(logits / temperature)`` (of ``softmax(logits)``
    at 0, greedy sampling)."""
    pack_len: int = 256
    """Tokens per packed row (a longer sequence gets a row of its own length)."""
    num_threads: int = 1
    seed: int = 0
    """Initial weights (when none are given) — version 0."""


@dataclass(frozen=True, kw_only=True)
class PackedRows:
    """Rows of packed sequences and where each sequence's trained tokens sit."""

    token_ids: torch.Tensor
    """``[R, L]``"""
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    """``-1`` marks the unfilled tail of a row."""
    logit_index: torch.Tensor
    """``[N]`` flat index into ``[R * L]`` of the logits predicting each trained token."""
    target_ids: torch.Tensor
    """``[N]`` the trained tokens, sequences in input order."""


def pack_rows(lengths: list[int], pack_len: int) -> list[list[int]]:
    """First-fit-decreasing: indices of ``lengths`` per row of at most ``pack_len`` tokens (a longer sequence
    gets a row of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []  # sequence indices per row
    fill: list[int] = []
    for i in order:
        for r, used in enumerate(fill):
            if used + lengths[i] <= pack_len:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return rows


def pack(sequences: list[tuple[tuple[int, ...], tuple[int, ...]]], pack_len: int,
         rows: list[list[int]] | None = None) -> PackedRows:
    """Pack ``(prompt_ids, response_ids)`` pairs; the response tokens are the trained ones. ``rows`` (indices
    into ``sequences`` per row) skips the packing when the caller has already done it (``pack_rows``)."""
    if rows is None:
        rows = pack_rows([len(p) + len(r) for p, r in sequences], pack_len)
    fill = [sum(len(sequences[i][0]) + len(sequences[i][1]) for i in row) for row in rows]
    width = max(max(fill), 1) if fill else 1
    # Built as Python lists and converted once: a tensor per sequence costs more than the tokens it holds.
    tokens: list[list[int]] = []
    positions: list[list[int]] = []
    segments: list[list[int]] = []
    start = [0] * len(sequences)  # flat index into [R * width] of each sequence's first token
    for r, members in enumerate(rows):
        row_tokens: list[int] = []
        row_positions: list[int] = []
        row_segments: list[int] = []
        for seg, i in enumerate(members):
            prompt, response = sequences[i]
            n = len(prompt) + len(response)
            start[i] = r * width + len(row_tokens)
            row_tokens += prompt
            row_tokens += response
            row_positions += range(n)
            row_segments += [seg] * n
        pad = width - len(row_tokens)
        tokens.append(row_tokens + [0] * pad)
        positions.append(row_positions + [0] * pad)
        segments.append(row_segments + [-1] * pad)
    index: list[int] = []
    targets: list[int] = []
    for i, (prompt, response) in enumerate(sequences):
        first = start[i] + len(prompt) - 1
        index += range(first, first + len(response))
        targets += response

    def rows_tensor(values: list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).reshape(len(rows), width)

    return PackedRows(
        token_ids=rows_tensor(tokens), position_ids=rows_tensor(positions), segment_ids=rows_tensor(segments),
        logit_index=torch.tensor(index, dtype=torch.int64), target_ids=torch.tensor(targets, dtype=torch.int64),
    )


def trained_log_softmax(logits: torch.Tensor, packed: PackedRows, temperature: float) -> torch.Tensor:
    """``[N, vocab]`` log-softmax of ``logits / temperature`` (``logits [R, L, vocab]`` of ``packed``'s rows)
    at the positions predicting trained tokens; temperature 0 (greedy) scores under ``softmax(logits)``, as the
    sampler records it (``sampling.logit_scale``)."""
    picked = logits.reshape(-1, logits.shape[-1])[packed.logit_index.to(logits.device)]
    return torch.log_softmax(picked.float() / logit_scale(temperature), dim=-1)


def target_logprobs(logits: torch.Tensor, packed: PackedRows, temperature: float = 1.0) -> torch.Tensor:
    """``[N]`` log-probs (nats) of the trained tokens under ``softmax(logits / temperature)``."""
    logp = trained_log_softmax(logits, packed, temperature)
    return logp.gather(1, packed.target_ids.to(logp.device)[:, None]).squeeze(1)


def token_logprobs(model: TinyTransformer, packed: PackedRows, temperature: float = 1.0) -> torch.Tensor:
    """``[N]`` log-probs (nats) of the trained tokens under ``softmax(logits / temperature)``.

    The rows' sequences go through ``TinyTransformer.forward_sequences``: the same logits as ``forward_rows`` on
    the rows, with neither the rows' padding nor attention across sequences computed."""
    real = packed.segment_ids.reshape(-1) >= 0
    keep = real.nonzero().squeeze(1)
    logits = model.forward_sequences(packed.token_ids.reshape(-1)[keep], packed.position_ids.reshape(-1)[keep],
                                     (torch.cumsum(real, 0) - 1)[packed.logit_index])  # row offsets -> flat ones
    scale = logit_scale(temperature)
    logits = logits.float() if scale == 1.0 else logits.float() / scale  # dividing by 1 is exact: skip the pass
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, packed.target_ids[:, None]).squeeze(1)


@dataclass(frozen=True, kw_only=True)
class GRPOSettings:
    """What one GRPO step needs beyond the model: the loss (``grpo.policy_loss``) and how the batch is split."""

    off_policy_correction: OffPolicyCorrection
    is_weight_cap: float | None
    ppo_clip_eps: float
    num_minibatches: int
    temperature: float
    pack_len: int
    ppo_epochs: int = 1
    kl_coef: float = 0.0
    microbatch_rows: int = 0
    """Packed rows per forward/backward (gradients accumulate over a minibatch's microbatches, then one
    optimiser step); 0: a minibatch in one forward."""

    @classmethod
    def of(cls, config: object) -> GRPOSettings:
        """The settings a trainer config carries under the same field names."""
        return cls(**{f: getattr(config, f) for f in cls.__dataclass_fields__ if hasattr(config, f)})


class GradientSteps(Protocol):
    """How a trainer applies gradients; ``grpo_step`` calls, per minibatch: ``zero_grad``, ``backward`` once per
    microbatch, then ``apply_gradients`` (clip and update; returns the gradient norm). ``StepInParts`` calls
    ``scale_gradients`` (multiply the accumulated gradients) before ``apply_gradients``."""

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def scale_gradients(self, factor: float) -> None: ...

    def apply_gradients(self) -> float: ...


def _microbatches(batch: list[ScoredTrajectory], chunk: list[int],
                  settings: GRPOSettings) -> list[tuple[list[int], PackedRows]]:
    """``chunk`` (indices into ``batch``) packed, and split into microbatches of ``microbatch_rows`` rows each
    (all rows at once when 0): ``(indices into batch, their packed rows)`` per microbatch, packed once."""
    rows = pack_rows([batch[i].trajectory.num_tokens for i in chunk], settings.pack_len)
    step = settings.microbatch_rows if settings.microbatch_rows > 0 else max(len(rows), 1)
    out = []
    for r in range(0, len(rows), step):
        group = rows[r : r + step]
        members = [chunk[j] for row in group for j in row]
        local, n = [], 0
        for row in group:
            local.append(list(range(n, n + len(row))))
            n += len(row)
        seqs = [(batch[i].trajectory.prompt_ids, batch[i].trajectory.response_ids) for i in members]
        out.append((members, pack(seqs, settings.pack_len, rows=local)))
    return out


def grpo_step(
    batch: list[ScoredTrajectory],
    settings: GRPOSettings,
    version: int,
    logprobs: Callable[[PackedRows], torch.Tensor],
    gradients: GradientSteps,
    reference: Callable[[PackedRows], torch.Tensor] | None = None,
) -> TrainMetrics:
    """One GRPO ``train_step`` on any model: advantages per group, the batch split into ``num_minibatches``
    minibatches of packed microbatches, no-grad forwards of each microbatch first (the proximal policy's, when the
    step takes several optimiser steps; the reference policy's, with a KL penalty), then ``ppo_epochs`` passes,
    each taking per minibatch the token losses of each microbatch and one optimiser step.
    ``logprobs(rows)`` gives the trained tokens' log-probs in ``rows.target_ids`` order, ``reference(rows)`` the
    reference policy's (needed when ``kl_coef`` > 0). The loss is the token mean over the whole batch (of each
    pass; the reported loss is the passes' mean) plus ``kl_coef`` times the token mean of
    ``exp(ref - logp) - (ref - logp) - 1``, GRPO's "k3" estimate of KL(pi || ref): non-negative, and unbiased for
    tokens sampled from pi (here they come from the behaviour policy, which staleness moves away from pi; the term
    has no importance weight, as in GRPO and verl); as a loss its expected gradient is that of KL(ref || pi).
    Reports the metrics of producing ``version + 1``.
    """
    if not batch:
        raise ValueError("train_step needs a non-empty batch")
    cfg = settings
    if cfg.kl_coef > 0 and reference is None:
        raise ValueError(f"kl_coef {cfg.kl_coef} needs the reference policy's log-probs, and none were given")
    start = time.perf_counter()
    advantages = group_advantages([s.reward for s in batch], [s.group_id for s in batch])
    chunks = [list(range(len(batch)))[m :: cfg.num_minibatches] for m in range(cfg.num_minibatches)]
    plan = [_microbatches(batch, chunk, cfg) for chunk in chunks if chunk]
    unset: list[list[torch.Tensor | None]] = [[None] * len(m) for m in plan]
    proximal, ref_logp = unset, unset
    with torch.no_grad():
        if len(plan) * cfg.ppo_epochs > 1:  # several optimiser steps: the ratio is to the weights before the first
            proximal = [[logprobs(rows) for _, rows in minibatch] for minibatch in plan]
        if cfg.kl_coef > 0 and reference is not None:
            ref_logp = [[reference(rows) for _, rows in minibatch] for minibatch in plan]
    total_tokens = sum(len(s.trajectory.response_ids) for s in batch)
    loss_total, kl_total, grad_norm = 0.0, 0.0, 0.0
    stats: list[LossStats] = []
    for _ in range(cfg.ppo_epochs):
        for minibatch, prox_list, ref_list in zip(plan, proximal, ref_logp, strict=True):
            gradients.zero_grad()
            for (micro, rows), prox, ref in zip(minibatch, prox_list, ref_list, strict=True):
                loss_sum, kl_sum, st = _microbatch_loss(batch, micro, rows, advantages, prox, ref, cfg, logprobs)
                kl_total += kl_sum
                loss = loss_sum / total_tokens
                gradients.backward(loss)
                loss_total += float(loss.detach())
                stats.append(st)
            grad_norm = gradients.apply_gradients()
    return _metrics(batch, version, loss_total / cfg.ppo_epochs, kl_total, stats, grad_norm,
                    time.perf_counter() - start)


def _microbatch_loss(batch: list[ScoredTrajectory], micro: list[int], rows: PackedRows, advantages: list[float],
                     prox: torch.Tensor | None, ref: torch.Tensor | None, cfg: GRPOSettings,
                     logprobs: Callable[[PackedRows], torch.Tensor]) -> tuple[torch.Tensor, float, LossStats]:
    """One microbatch's summed token loss (the KL term added when ``ref`` is given), that KL sum, and its stats."""
    logp = logprobs(rows)
    behaviour = torch.tensor([lp for i in micro for lp in batch[i].trajectory.behaviour_logprobs], device=logp.device)
    adv = torch.tensor([advantages[i] for i in micro for _ in batch[i].trajectory.response_ids], device=logp.device)
    loss_sum, st = policy_loss(
        logp, logp.detach() if prox is None else prox, behaviour, adv,
        correction=cfg.off_policy_correction, clip_eps=cfg.ppo_clip_eps, is_weight_cap=cfg.is_weight_cap,
    )
    kl = 0.0
    if ref is not None:
        log_ratio = ref - logp
        kl_sum = (torch.exp(log_ratio) - log_ratio - 1.0).sum()
        loss_sum = loss_sum + cfg.kl_coef * kl_sum
        kl = float(kl_sum.detach())
    return loss_sum, kl, st


def _metrics(batch: list[ScoredTrajectory], version: int, loss: float, kl_total: float, stats: list[LossStats],
             grad_norm: float, train_time_s: float) -> TrainMetrics:
    staleness = [version - s.trajectory.version for s in batch]
    n_tok = sum(s.num_tokens for s in stats)
    return TrainMetrics(
        version=version + 1,
        loss=loss,
        kl_mean=kl_total / n_tok,
        num_sequences=len(batch),
        num_trained_tokens=sum(len(s.trajectory.response_ids) for s in batch),
        num_forward_tokens=sum(s.trajectory.num_tokens for s in batch),
        forward_sum_sq_tokens=sum(s.trajectory.num_tokens ** 2 for s in batch),
        reward_mean=sum(s.reward for s in batch) / len(batch),
        is_weight_mean=sum(s.is_weight_sum for s in stats) / n_tok,
        is_weight_max=max(s.is_weight_max for s in stats),
        is_weight_clip_frac=sum(s.is_weight_clipped for s in stats) / n_tok,
        ppo_clip_frac=sum(s.ppo_clipped for s in stats) / n_tok,
        mean_staleness=sum(staleness) / len(staleness),
        max_staleness=max(staleness),
        grad_norm=grad_norm,
        train_time_s=train_time_s,
        train_threads=torch.get_num_threads(),
    )


class StepInParts:
    """One GRPO training step whose batch arrives in parts, whole prompt groups each: an early step
    (``PolicyConfig.early_steps``) takes the groups still generating when it starts as they finish.

    Each part's microbatches run forward and backward as the part arrives, accumulating the gradients of their
    summed token losses; ``finish`` divides them by the whole batch's trained tokens (what ``grpo_step`` divides each
    microbatch's loss by, known only once the last part is in) and takes the step's one optimizer step. The step is
    ``grpo_step``'s with one minibatch and one PPO epoch (advantages are per group, so per part): the only kind of step
    that can start before its batch is complete. ``train_time_s`` counts the parts' work, not the waits between them.
    """

    def __init__(self, settings: GRPOSettings, version: int, logprobs: Callable[[PackedRows], torch.Tensor],
                 gradients: GradientSteps, reference: Callable[[PackedRows], torch.Tensor] | None = None) -> None:
        if settings.num_minibatches * settings.ppo_epochs != 1:
            raise ValueError(f"a step in parts takes one optimizer step: {settings.num_minibatches} minibatches x "
                             f"{settings.ppo_epochs} PPO epochs need the whole batch before the first")
        if settings.kl_coef > 0 and reference is None:
            raise ValueError(f"kl_coef {settings.kl_coef} needs the reference policy's log-probs, and none were given")
        self.settings, self.version, self.logprobs, self.gradients = settings, version, logprobs, gradients
        self.reference = reference if settings.kl_coef > 0 else None
        self.batch: list[ScoredTrajectory] = []
        self.loss_sum = self.kl_total = self.busy_s = 0.0
        self.stats: list[LossStats] = []
        gradients.zero_grad()

    def add(self, part: list[ScoredTrajectory]) -> None:
        """Forward and backward over ``part`` (whole groups), its gradients added to the step's."""
        start = time.perf_counter()
        advantages = group_advantages([s.reward for s in part], [s.group_id for s in part])
        for micro, rows in _microbatches(part, list(range(len(part))), self.settings):
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = self.reference(rows)
            loss_sum, kl, st = _microbatch_loss(part, micro, rows, advantages, None, ref, self.settings, self.logprobs)
            self.gradients.backward(loss_sum)
            self.loss_sum += float(loss_sum.detach())
            self.kl_total += kl
            self.stats.append(st)
        self.batch.extend(part)
        self.busy_s += time.perf_counter() - start

    def finish(self, last: list[ScoredTrajectory]) -> TrainMetrics:
        """Add the ``last`` part, scale the accumulated gradients to the batch's token mean and take the optimizer
        step."""
        if last:
            self.add(last)
        if not self.batch:
            raise ValueError("train_step needs a non-empty batch")
        start = time.perf_counter()
        total_tokens = sum(len(s.trajectory.response_ids) for s in self.batch)
        self.gradients.scale_gradients(1.0 / total_tokens)
        grad_norm = self.gradients.apply_gradients()
        return _metrics(self.batch, self.version, self.loss_sum / total_tokens, self.kl_total, self.stats, grad_norm,
                        self.busy_s + time.perf_counter() - start)


def scale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiply every accumulated gradient of ``model`` by ``factor``."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def train_mode(model: torch.nn.Module, run: Callable[[], T]) -> T:
    """``run()`` with ``model`` in training mode, back in evaluation mode after (the engines' forwards are too)."""
    model.train()
    try:
        return run()
    finally:
        model.eval()


class GRPOSteps(ABC):
    """``train_part`` and ``train_step`` for a trainer that has ``model``, ``version`` and ``step`` and implements
    the abstract methods below: the ``GradientSteps`` ones, ``grpo_settings``, ``logprobs`` and
    ``_reference_logprobs``."""

    model: torch.nn.Module
    version: int
    step: int
    parts: StepInParts | None = None
    """The step ``train_part`` began, until ``train_step`` ends it."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def scale_gradients(self, factor: float) -> None: ...

    @abstractmethod
    def apply_gradients(self) -> float: ...

    @abstractmethod
    def grpo_settings(self) -> GRPOSettings:
        """The step's GRPO settings."""

    @abstractmethod
    def logprobs(self, rows: PackedRows) -> torch.Tensor:
        """The trained model's per-token log-probabilities of ``rows``, with gradients."""

    @abstractmethod
    def _reference_logprobs(self) -> Callable[[PackedRows], torch.Tensor] | None:
        """The reference policy's log-probabilities, when the KL term needs them."""

    def train_part(self, part: list[ScoredTrajectory]) -> None:
        """Part of the next step's batch (whole groups), the rest to come: see ``StepInParts``."""
        if self.parts is None:
            self.parts = StepInParts(self.grpo_settings(), self.version, self.logprobs, self,
                                     reference=self._reference_logprobs())
        parts = self.parts
        train_mode(self.model, lambda: parts.add(part))

    def train_step(self, batch: list[ScoredTrajectory]) -> TrainMetrics:
        """One GRPO step on ``batch``, or, after ``train_part`` calls, on their parts and this last one."""
        parts, self.parts = self.parts, None
        if parts is None:
            metrics = train_mode(self.model, lambda: grpo_step(
                batch, self.grpo_settings(), self.version, self.logprobs, self,
                reference=self._reference_logprobs()))
        else:
            metrics = train_mode(self.model, lambda: parts.finish(batch))
        self.version += 1
        self.step += 1
        return metrics


class TorchTrainer(GRPOSteps):
    """Implements ``Trainer`` (see ``base.py``)."""

    model: TinyTransformer

    def __init__(self, config: TrainerConfig, *, initial_weights: dict[str, torch.Tensor] | None = None) -> None:
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = TinyTransformer(config.model, seed=config.seed)
        if initial_weights is not None:
            self.model.load_state_dict(initial_weights)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.learning_rate, betas=config.adam_betas,
            weight_decay=config.weight_decay,
        )
        self.version = 0
        self.step = 0
        self.reference: TinyTransformer | None = None
        """The KL penalty's reference policy: version 0's weights, frozen at the first step (after the warm-up)."""

    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, export_weights(self.model)

    def state_dict(self) -> dict[str, object]:
        """A snapshot: the optimiser's state dict references its live moment tensors, so it is copied."""
        state = {
            "model": export_weights(self.model), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "step": self.step, "version": self.version,
        }
        if self.reference is not None:
            state["reference"] = export_weights(self.reference)
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.model.load_state_dict(state["model"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        self.step = int(state["step"])  # type: ignore[call-overload]
        self.version = int(state["version"])  # type: ignore[call-overload]
        reference = state.get("reference")
        self.reference = None if reference is None else model_from_weights(self.config.model, reference)  # type: ignore[arg-type]

    def _reference_logprobs(self) -> Callable[[PackedRows], torch.Tensor] | None:
        """The reference policy's log-probs (None without a KL penalty), freezing version 0's weights first."""
        if self.config.kl_coef == 0:
            return None
        if self.reference is None:
            if self.version != 0:
                raise RuntimeError(f"kl_coef needs the reference policy (version 0's weights), but the trainer is at "
                                   f"version {self.version} and has none: its checkpoint was written without them")
            self.reference = model_from_weights(self.config.model, export_weights(self.model))
        reference = self.reference
        return lambda rows: token_logprobs(reference, rows, self.config.temperature)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def scale_gradients(self, factor: float) -> None:
        scale_gradients(self.model, factor)

    def apply_gradients(self) -> float:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        return grad_norm

    def grpo_settings(self) -> GRPOSettings:
        return GRPOSettings.of(self.config)

    def logprobs(self, rows: PackedRows) -> torch.Tensor:
        return token_logprobs(self.model, rows, self.config.temperature)

    def supervised_step(
        self,
        examples: list[tuple[tuple[int, ...], tuple[int, ...]]],
        optimizer: torch.optim.Optimizer,
        *,
        label_smoothing: float = 0.0,
    ) -> float:
        """One cross-entropy step on the response tokens (token mean) — the warm-up; no version bump.

        With smoothing ``e`` the target is ``(1 - e) * onehot + e * uniform(vocab)``:
        ``loss = -(1 - e) * log p_target - e * mean_v log p_v``.
        """
        self.model.train()
        packed = pack(examples, self.config.pack_len)
        logits = self.model.forward_rows(packed.token_ids, packed.position_ids, packed.segment_ids)
        logp = trained_log_softmax(logits, packed, 1.0)
        target = logp.gather(1, packed.target_ids[:, None]).squeeze(1)
        loss = -((1.0 - label_smoothing) * target + label_smoothing * logp.mean(dim=-1)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        optimizer.step()
        self.model.eval()
        return float(loss.detach())


def warm_up(
    trainer: TorchTrainer,
    task: TaskConfig,
    lengths: LengthSampler,
    *,
    seed: int,
    learning_rate: float = 3e-3,
    cache_dir: Path | None = None,
    notes: list[str] | None = None,
) -> list[float]:
    """Supervised warm-up of ``trainer.model`` on the task's correct answers (version stays 0).

    Returns the per-step losses (empty when the weights came from the cache).
    The cache file name is a hash of everything that determines the result, so a
    changed model, task, length distribution, seed or rate never reuses stale weights.
    A cache file that cannot be loaded (cut, damaged) is a miss: the warm-up runs and writes it again, and a line
    saying so is appended to ``notes``.
    """
    key = repr((trainer.config.model, task, lengths, seed, learning_rate, trainer.config.pack_len))
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"warmup-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
        if path.exists():
            try:  # only the read: a file that loads but does not fit the model is a bug, not damage
                cached = torch.load(path, weights_only=True)
            except Exception as exc:  # whatever broke the file, warming up again recomputes exactly its weights
                detail = str(exc).split("\n")[0].split(". ")[0] or "no detail"  # torch's advice follows
                if notes is not None:
                    notes.append(f"the warm-up cache {path} is unreadable ({type(exc).__name__}: {detail}): warming "
                                 "up again, and overwriting it")
            else:
                trainer.model.load_state_dict(cached)
                return []
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=learning_rate, betas=(0.9, 0.99))
    losses = [
        trainer.supervised_step(warmup_examples(task, lengths, rng, task.warmup_batch_size), optimizer,
                                label_smoothing=task.warmup_label_smoothing)
        for _ in range(task.warmup_steps)
    ]
    if path is not None:
        _save_atomic(export_weights(trainer.model), path)
    return losses


def _save_atomic(obj: object, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` through a temporary file of its own in the same directory, fsynced, then
    renamed: a concurrent reader never sees half a file, and runs sharing the cache that warm up at the same time
    never write through one another's temporary file. When another run renamed its copy in first, this one replaces
    it with the same weights (the name is a hash of everything that determines them)."""
    from dora.runtime.trace import write_atomic

    write_atomic(path, lambda f: torch.save(obj, f))
