"""Counter-based sampling: the noise for a token is a pure function of (seed, position, vocab id).

Why not a ``torch.Generator`` per request: one generator call per sequence per
step is slow in a batch of 128, and a stateful generator cannot follow a request
that is migrated to another engine or resumed after an abort. Hashing the
counter instead gives the same tokens however requests are batched, moved or
resumed, and costs one vectorised pass over ``[batch, vocab]``.

Sampling is Gumbel-max: ``y = argmax_j (log p_j + g_j)`` with
``g_j = -log(-log(u_j))`` and ``u_j`` uniform on (0, 1), which draws ``y`` from
``p = softmax(logits / temperature)``. The recorded behaviour log-prob is
``log p_y`` (nats). Temperature 0 means greedy; its recorded log-prob is then
taken under ``softmax(logits)``.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 keep every product of a 32-bit value below 2**63,
# so int64 arithmetic never overflows.
_MULTIPLIERS = (0x2C1B3C6D, 0x297A2D39, 0x7FEB352D)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """Avalanche a tensor of 32-bit values held in int64 (xor-shift / multiply rounds)."""
    for mult in _MULTIPLIERS:
        h = h ^ (h >> 16)
        h = (h * mult) & _MASK32
    return h ^ (h >> 15)


def noise_key(seed: int) -> int:
    """The per-request key ``uniform_noise`` derives from a seed, in Python: the engine computes it once per request
    instead of hashing every row's seed again at every step (the same integer arithmetic, so the same value)."""
    def mix(h: int) -> int:
        for mult in _MULTIPLIERS:
            h ^= h >> 16
            h = (h * mult) & _MASK32
        return h ^ (h >> 15)

    seed &= 2**64 - 1  # the bits of the int64 the seed is stored as (a negative seed's high half is sign bits)
    return mix(seed & _MASK32) ^ mix(((seed >> 32) & _MASK32) ^ 0x5BD1E995)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``u[b, j]`` in (0, 1), float64, a function of ``(seeds[b], positions[b], j)`` only."""
    seeds = seeds.to(torch.int64)
    keys = _mix32(seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ 0x5BD1E995)
    return keyed_noise(keys, positions, vocab_size)


def keyed_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``uniform_noise`` from the seeds' keys (``noise_key``)."""
    per_position = _mix32((keys ^ (positions.to(torch.int64) * 0x3C6EF372)) & _MASK32)
    vocab = torch.arange(vocab_size, dtype=torch.int64) * 0x1B873593
    h = _mix32((per_position[:, None] ^ vocab[None, :]) & _MASK32)
    # Dividing by a power of two is exact, so scaling in place by its inverse gives the same bits, one buffer.
    return h.to(torch.float64).add_(0.5).mul_(2.0**-32)


def logit_scale(temperature: float) -> float:
    """What logits are divided by for log-probs at ``temperature``: itself, or 1 when greedy (``temperature <= 0``,
    see the module doc). The trainers score tokens with it too, so a greedy run's behaviour and trained log-probs
    are under the same ``softmax(logits)`` (dividing by 0 gave NaN)."""
    return temperature if temperature > 0 else 1.0


def sample_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(tokens [B] int64, logprobs [B] float32)``.

    ``positions[b]`` is the index of the token being sampled within the response.
    """
    seeds = seeds.to(torch.int64)
    keys = _mix32(seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ 0x5BD1E995)
    return sample_keyed(logits, temperatures, keys, positions)


def sample_keyed(
    logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
    *, any_greedy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens`` with the seeds' keys (``noise_key``); ``any_greedy=False`` promises no temperature is
    ``<= 0`` and skips the per-row greedy select (it would keep every row's noise as it is)."""
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)  # logit_scale, per row
    logp = torch.log_softmax(logits.float() / scale[:, None], dim=-1)
    # -log(-log(u)), in place: the same operations on the same float64 buffer.
    gumbel = keyed_noise(keys, positions, logits.shape[-1]).log_().neg_().log_().neg_()
    if any_greedy:
        gumbel = torch.where(greedy[:, None], torch.zeros_like(gumbel), gumbel)
    tokens = torch.argmax(gumbel.add_(logp.double()), dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
