"""Verifiable tasks a tiny model can learn on CPU: prompts, rewards and warm-up data.

Task ``count``: the prompt is ``[BOS, a, b, SEP]`` with ``a <= b`` number
tokens; the correct response is ``a, a+1, ..., b, EOS``. The response length
``L = b - a + 2`` (numbers plus EOS) is drawn from the workload's response-length
distribution (``planner.workload.LengthDistribution``), so the rollout engine
sees the same long tail the planner predicts. A length of 1 is raised to 2 (a
response holds at least one number) and lengths are capped at
``min(max_tokens, number_tokens + 1)``.

Response budget: each request is generated with ``max_new_tokens = L`` and
``min_new_tokens = L - 1`` (``Prompt.max_new_tokens`` / ``min_new_tokens``: an
instruction "answer in exactly L tokens" enforced by the engine, EOS masked
before the last one). So the generated lengths *are* the workload's drawn
lengths (the planner's prediction) whatever the policy's quality. Without the
budget, a warmed-up policy that is unsure on long prompts learns to stop early
(as cheap as a wrong number) and the rollout loses the long tail it exists to
show; with only the cap, early stops after an error still thin the tail.
The EOS mask makes the recorded behaviour log-probs those of the masked
distribution, ``mu = p / (1 - p_EOS)`` before the last token: an IS weight
``1 - p_EOS`` (close to 1 once the policy counts) that the off-policy
correction accounts for like any other engine/trainer mismatch.

Reward (verifiable, in [0, 1]): ``c / max(L, n)`` with ``c`` the length of the
longest correct prefix and ``n = len(response)``: 1 for an exact answer,
partial credit for counting correctly for a while (a dense signal GRPO can
climb); stopping early forfeits the rest. The ``n`` charges overrunning for its
extra tokens when no budget is enforced (otherwise never stopping is cheap).

Warm-up: supervised steps on correct answers with label smoothing
``warmup_label_smoothing`` (target distribution ``(1 - e) * onehot + e * uniform``).
Trained to convergence, the model counts and stops by the rule but, sampled at
temperature 1, picks a wrong token with probability about ``e`` per token, so
it starts RL imperfect (reward ~0.4 at ``e = 0.2``) in the same way whatever the
seed — unlike a warm-up cut short, whose quality depends on where training
happened to stop. RL then has a clear, learnable job: sharpen the policy onto
the rule. (Smoothing, not random label noise: the same target distribution
without the gradient variance that slows Adam down.)

Vocabulary: ``BOS = 0``, ``EOS = 1``, ``SEP = 2``, number ``n`` is token ``3 + n``
for ``0 <= n < number_tokens``; ``vocab_size = 3 + number_tokens``.

Everything is a pure function of its inputs and a ``random.Random``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, Protocol

BOS, EOS, SEP = 0, 1, 2
FIRST_NUMBER_TOKEN = 3
PROMPT_TOKENS = 4
"""Every prompt is ``[BOS, a, b, SEP]``: the spec's ``workload.prompt_length`` must say so (``dora.spec.checks``)."""
MIN_RESPONSE_TOKENS = 2
"""The shortest answer, one number and EOS: ``workload.response_length.max_tokens`` must leave room for it."""


class LengthSampler(Protocol):
    """What the task needs from ``planner.workload.LengthDistribution``."""

    @property
    def max_tokens(self) -> int: ...

    def sample(self, rng: random.Random) -> int: ...


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The task a run learns. The spec layer mirrors these fields."""

    name: Literal["count"] = "count"
    number_tokens: int = 189
    """Distinct numbers; must be ``>= max_tokens - 1`` of the length distribution. Vocab = 3 + this."""
    warmup_steps: int = 500
    """Supervised steps before RL (enough to converge on the noisy warm-up data)."""
    warmup_batch_size: int = 32
    """Sequences per supervised warm-up step."""
    warmup_label_smoothing: float = 0.2
    """Label smoothing of the warm-up targets: about the warmed-up policy's per-token error rate."""

    def __post_init__(self) -> None:
        if self.number_tokens < 2:
            raise ValueError(f"number_tokens({self.number_tokens}) must be >= 2")
        if not 0.0 <= self.warmup_label_smoothing < 1.0:
            raise ValueError(f"warmup_label_smoothing({self.warmup_label_smoothing}) must be in [0, 1)")
        if self.warmup_steps < 0 or self.warmup_batch_size < 1:
            raise ValueError(
                f"warmup_steps({self.warmup_steps}) must be >= 0 and warmup_batch_size({self.warmup_batch_size}) >= 1"
            )

    @property
    def vocab_size(self) -> int:
        return FIRST_NUMBER_TOKEN + self.number_tokens

    @property
    def eos_token_id(self) -> int:
        return EOS


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One task instance."""

    prompt_id: str
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    """The correct response, EOS included; ``len(target_ids)`` is the drawn length ``L``."""

    @property
    def max_new_tokens(self) -> int:
        """The response budget ``L`` to generate this prompt with (see the module docstring)."""
        return len(self.target_ids)

    @property
    def min_new_tokens(self) -> int:
        """EOS is allowed only as the ``L``-th token (see the module docstring)."""
        return len(self.target_ids) - 1


def make_prompt(config: TaskConfig, lengths: LengthSampler, rng: random.Random, prompt_id: str) -> Prompt:
    """Draw ``L`` from ``lengths``, then a start ``a`` uniform over the numbers that fit.

    Raises ``ValueError`` when the length cap leaves no room for an answer (the spec check refuses such a spec
    first: this is the second line of defence)."""
    if lengths.max_tokens < MIN_RESPONSE_TOKENS:
        raise ValueError(f"workload.response_length.max_tokens is {lengths.max_tokens}, but the count task's shortest "
                         f"answer is {MIN_RESPONSE_TOKENS} tokens (one number and EOS): set it to at least "
                         f"{MIN_RESPONSE_TOKENS}")
    max_len = min(lengths.max_tokens, config.number_tokens + 1)
    length = min(max(lengths.sample(rng), 2), max_len)
    count = length - 1
    start = rng.randrange(config.number_tokens - count + 1)
    numbers = tuple(FIRST_NUMBER_TOKEN + start + i for i in range(count))
    return Prompt(
        prompt_id=prompt_id,
        prompt_ids=(BOS, numbers[0], numbers[-1], SEP),
        target_ids=(*numbers, EOS),
    )


def make_prompts(config: TaskConfig, lengths: LengthSampler, rng: random.Random, n: int, *, prefix: str = "p") -> list[Prompt]:
    return [make_prompt(config, lengths, rng, f"{prefix}{i}") for i in range(n)]


def score(prompt: Prompt, response_ids: tuple[int, ...] | list[int]) -> float:
    """Longest correct prefix over ``max(len(target), len(response))``; 1.0 iff exact."""
    correct = 0
    for got, want in zip(response_ids, prompt.target_ids, strict=False):
        if got != want:
            break
        correct += 1
    return correct / max(len(prompt.target_ids), len(response_ids))


def warmup_examples(
    config: TaskConfig, lengths: LengthSampler, rng: random.Random, n: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``n`` supervised pairs ``(prompt_ids, correct response)`` from the task's own distribution."""
    return [(p.prompt_ids, p.target_ids) for p in make_prompts(config, lengths, rng, n, prefix="w")]
