"""Workload: response-length distributions and the shape of one RL step's batch.

Notation:
    L       response length in tokens (integer, ``min_tokens <= L <= max_tokens``)
    mu      log of the median, ``mu = ln(median)``
    sigma   log-space standard deviation
    z_q     standard-normal quantile, ``z_0.99 = 2.3263...``

Lognormal: ``ln X ~ N(mu, sigma^2)`` with ``sigma = (ln p99 - ln median) / z_0.99``; the sampled
length is ``L = clamp(round(X), min_tokens, max_tokens)``. Clamping (not rejection) is deliberate:
an inference engine stops a response at ``max_tokens``, so the probability mass above the cap
turns into responses of exactly ``max_tokens`` -- the RL "truncated" samples that make the tail.

Empirical: a histogram of ``(length, count)`` pairs given as data (the spec layer reads files; this
module never does I/O). Sampling picks a bin with probability ``count / total``.

Everything is stdlib-only and deterministic given a ``random.Random``; the local CPU task draws its
target lengths from the same class.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

_STD_NORMAL = NormalDist()
_SMALLEST_DRAW = 2.0**-53
"""Stands in for a uniform draw of exactly 0 (probability 2^-53), whose normal quantile is -infinity."""
_inv_cdf: Callable[[float, float, float], float] = getattr(
    statistics, "_normal_dist_inv_cdf", lambda p, mu, sigma: NormalDist(mu, sigma).inv_cdf(p)
)
"""``(u, mu, sigma) -> x`` with ``P(X <= x) = u``: the C function behind ``NormalDist.inv_cdf`` (CPython 3.11-3.13)
without the method's argument checks (``sample_many`` only passes ``0 < u < 1``), or else the method."""
Z_P99 = _STD_NORMAL.inv_cdf(0.99)  # 2.3263478740408408


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthDistribution:
    """A distribution of response lengths in tokens; build it with ``lognormal`` or ``empirical``."""

    kind: Literal["lognormal", "empirical"]
    max_tokens: int
    """Hard cap: the engine stops generating at this many tokens."""
    min_tokens: int = 1
    median_tokens: float = 0.0
    """Lognormal only: median of the untruncated lognormal."""
    sigma: float = 0.0
    """Lognormal only: log-space standard deviation."""
    lengths: tuple[int, ...] = ()
    """Empirical only: bin lengths (ascending, already clamped to ``[min_tokens, max_tokens]``)."""
    cumulative_counts: tuple[int, ...] = ()
    """Empirical only: running sum of counts, same order as ``lengths``."""

    # ----------------------------------------------------------------- constructors
    @staticmethod
    def lognormal(*, median: float, p99: float, max_tokens: int, min_tokens: int = 1) -> LengthDistribution:
        """Lognormal with the given median and 99th percentile (before clamping), clamped to the range.

        ``sigma = (ln p99 - ln median) / z_0.99``; ``p99 == median`` gives a point mass.
        """
        if not (median > 0 and p99 >= median):
            raise ValueError(f"lognormal needs 0 < median <= p99, got median={median}, p99={p99}")
        if not (1 <= min_tokens <= max_tokens):
            raise ValueError(f"need 1 <= min_tokens({min_tokens}) <= max_tokens({max_tokens})")
        sigma = (math.log(p99) - math.log(median)) / Z_P99
        return LengthDistribution(
            kind="lognormal", max_tokens=max_tokens, min_tokens=min_tokens, median_tokens=float(median), sigma=sigma
        )

    @staticmethod
    def empirical(
        *, histogram: list[tuple[int, int]] | tuple[tuple[int, int], ...], max_tokens: int, min_tokens: int = 1
    ) -> LengthDistribution:
        """Histogram of ``(length_tokens, count)`` pairs; lengths are clamped to ``[min_tokens, max_tokens]``."""
        if not (1 <= min_tokens <= max_tokens):
            raise ValueError(f"need 1 <= min_tokens({min_tokens}) <= max_tokens({max_tokens})")
        merged: dict[int, int] = {}
        for i, pair in enumerate(histogram):
            if len(pair) != 2:
                raise ValueError(f"histogram[{i}] must be a (length, count) pair, got {pair!r}")
            length, count = pair
            if int(count) != count or count < 0:
                raise ValueError(f"histogram[{i}]: count must be a non-negative integer, got {count!r}")
            if int(length) != length or length < 1:
                raise ValueError(f"histogram[{i}]: length must be a positive integer, got {length!r}")
            clamped = min(max(int(length), min_tokens), max_tokens)
            merged[clamped] = merged.get(clamped, 0) + int(count)
        lengths = tuple(sorted(k for k, c in merged.items() if c > 0))
        if not lengths:
            raise ValueError("empirical histogram has no positive counts")
        running, cumulative = 0, []
        for length in lengths:
            running += merged[length]
            cumulative.append(running)
        return LengthDistribution(
            kind="empirical",
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            lengths=lengths,
            cumulative_counts=tuple(cumulative),
        )

    # ----------------------------------------------------------------- sampling
    def sample(self, rng: random.Random) -> int:
        """One length in tokens; consumes a deterministic number of draws from ``rng``."""
        if self.kind == "lognormal":
            x = math.exp(self._log_quantile()(rng.random() or _SMALLEST_DRAW))
            return min(max(round(x), self.min_tokens), self.max_tokens)
        pick = rng.randrange(self.cumulative_counts[-1])
        return self.lengths[bisect.bisect_right(self.cumulative_counts, pick)]

    def sample_many(self, rng: random.Random, n: int) -> list[int]:
        """``n`` lengths; equal to ``[self.sample(rng) for _ in range(n)]`` but cheaper per draw.

        Draw by draw, so ``sample_many(rng, a) + sample_many(rng, b) == sample_many(rng, a + b)`` (the simulator
        draws ahead in blocks)."""
        if self.kind == "lognormal":
            rand, lo, hi, exp = rng.random, self.min_tokens, self.max_tokens, math.exp
            mu, sigma = math.log(self.median_tokens), self.sigma
            if sigma == 0.0:
                for _ in range(n):
                    rand()  # ``sample`` draws once per length even then
                xs = [exp(mu)] * n
            else:  # the same arithmetic as ``sample``, draw by draw; the C inverse CDF: 40% cheaper per draw
                xs = [exp(_inv_cdf(rand() or _SMALLEST_DRAW, mu, sigma)) for _ in range(n)]
            # the clamp as comparisons (cheaper than min/max calls)
            return [lo if x < lo else hi if x > hi else x for x in map(round, xs)]
        total, cum, lengths, rr, br = self.cumulative_counts[-1], self.cumulative_counts, self.lengths, rng.randrange, bisect.bisect_right
        return [lengths[br(cum, rr(total))] for _ in range(n)]

    def _log_quantile(self) -> Callable[[float], float]:
        """``u -> ln`` of the unclamped length at quantile ``u`` (inverse-CDF sampling: one uniform draw per length,
        and ``NormalDist.inv_cdf`` runs in C, several times cheaper than ``random.gauss``)."""
        mu = math.log(self.median_tokens)
        if self.sigma == 0.0:
            return lambda _u: mu
        return NormalDist(mu, self.sigma).inv_cdf

    # ----------------------------------------------------------------- statistics
    def quantile(self, q: float) -> int:
        """Smallest length ``l`` with ``P(L <= l) >= q`` (up to rounding for the lognormal), ``0 < q < 1``."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile needs 0 < q < 1, got {q}")
        if self.kind == "lognormal":
            x = self.median_tokens * math.exp(self.sigma * _STD_NORMAL.inv_cdf(q))
            return min(max(round(x), self.min_tokens), self.max_tokens)
        target = q * self.cumulative_counts[-1]
        return self.lengths[min(bisect.bisect_left(self.cumulative_counts, target), len(self.lengths) - 1)]

    def mean_tokens(self) -> float:
        """Expected clamped length in tokens (rounding to integers ignored for the lognormal).

        For ``X`` lognormal and bounds ``a, b`` with ``alpha = (ln a - mu)/sigma``, ``beta = (ln b - mu)/sigma``:
        ``E[clamp(X,a,b)] = a*Phi(alpha) + e^(mu + sigma^2/2) * (Phi(beta - sigma) - Phi(alpha - sigma))
        + b*(1 - Phi(beta))``.
        """
        if self.kind == "empirical":
            prev, acc = 0, 0.0
            for length, cum in zip(self.lengths, self.cumulative_counts, strict=True):
                acc += length * (cum - prev)
                prev = cum
            return acc / self.cumulative_counts[-1]
        a, b = float(self.min_tokens), float(self.max_tokens)
        mu = math.log(self.median_tokens)
        if self.sigma == 0.0:
            return min(max(self.median_tokens, a), b)
        s = self.sigma
        alpha, beta = (math.log(a) - mu) / s, (math.log(b) - mu) / s
        cdf = _STD_NORMAL.cdf
        middle = math.exp(mu + s * s / 2.0) * (cdf(beta - s) - cdf(alpha - s))
        return a * cdf(alpha) + middle + b * (1.0 - cdf(beta))

    def second_moment_tokens(self) -> float:
        """``E[L^2]`` of the clamped length (rounding to integers ignored for the lognormal), exact: the cost model's
        contexts weigh a slot by how long it is held, so this is what they need, tail included.

        For ``X`` lognormal, with ``alpha``, ``beta`` as in ``mean_tokens``:
        ``E[clamp(X,a,b)^2] = a^2*Phi(alpha) + e^(2mu + 2sigma^2) * (Phi(beta - 2sigma) - Phi(alpha - 2sigma))
        + b^2*(1 - Phi(beta))``.
        """
        if self.kind == "empirical":
            prev, acc = 0, 0.0
            for length, cum in zip(self.lengths, self.cumulative_counts, strict=True):
                acc += length * length * (cum - prev)
                prev = cum
            return acc / self.cumulative_counts[-1]
        a, b = float(self.min_tokens), float(self.max_tokens)
        mu = math.log(self.median_tokens)
        if self.sigma == 0.0:
            return min(max(self.median_tokens, a), b) ** 2
        s = self.sigma
        alpha, beta = (math.log(a) - mu) / s, (math.log(b) - mu) / s
        cdf = _STD_NORMAL.cdf
        middle = math.exp(2.0 * mu + 2.0 * s * s) * (cdf(beta - 2.0 * s) - cdf(alpha - 2.0 * s))
        return a * a * cdf(alpha) + middle + b * b * (1.0 - cdf(beta))

    def truncated_fraction(self) -> float:
        """Probability that a response hits ``max_tokens`` (is cut by the cap), as ``sample`` draws them: a draw that
        rounds to ``max_tokens`` or more, or any draw when ``min_tokens`` is the cap."""
        if self.kind == "empirical":
            i = bisect.bisect_left(self.lengths, self.max_tokens)
            below = self.cumulative_counts[i - 1] if i > 0 else 0
            return (self.cumulative_counts[-1] - below) / self.cumulative_counts[-1] if i < len(self.lengths) else 0.0
        if self.min_tokens >= self.max_tokens:
            return 1.0
        if self.sigma == 0.0:
            return 1.0 if round(self.median_tokens) >= self.max_tokens else 0.0
        z = (math.log(self.max_tokens - 0.5) - math.log(self.median_tokens)) / self.sigma
        return 1.0 - _STD_NORMAL.cdf(z)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What one RL step generates: prompt groups of ``samples_per_prompt`` responses each."""

    response_length: LengthDistribution
    prompt_tokens: int
    """Prompt length in tokens (same for every prompt; its variance is small next to the response tail)."""
    length_per_prompt: bool = False
    """All samples of a prompt group share one response length, drawn once per group (a task whose prompt fixes the
    answer's length, like the local ``count`` task); otherwise every sample draws its own. A batch then holds
    ``prompts_per_step`` independent lengths instead of ``prompts_per_step * samples_per_prompt``, so its longest
    response, the one synchronous rollout waits for, is shorter."""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
