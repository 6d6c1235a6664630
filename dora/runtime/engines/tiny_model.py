"""A tiny decoder-only transformer with a slot-indexed KV cache, for CPU rollout and training.

Architecture (pre-norm, as in Llama): token embedding -> ``num_layers`` x
[RMSNorm -> grouped-query attention with rotary positions -> residual,
RMSNorm -> MLP -> residual] -> RMSNorm -> LM head (tied to the embedding
when ``tie_embeddings``). The MLP is ``gelu`` (with biases; dora's own CPU model)
or ``swiglu`` (no biases: Llama's, the one megatron-core builds from dora's
lowered config; ``hf_weights``/``tiny_weights`` map its weights to and from the
checkpoint's names). Rotary positions need no parameters, so the model is
fully described by the catalog fields (layers, hidden, heads, kv heads, head
dim, ffn, vocab, tie_embeddings) and positions are per sequence, which is what
lets one row hold several packed sequences.

Four forwards share the same weights and maths:

- ``forward_rows``: rows of tokens with a per-token segment id and position id
  (block-diagonal causal attention). Training packs many sequences into a row;
  prefill puts one request per row and writes its keys/values into the cache.
- ``forward_sequences``: the training forward. The same tokens as ``forward_rows``' packed rows, flat and
  without the rows' padding; attention runs one sequence at a time (sequences batched by length,
  ``SequenceLayout``) with a plain causal mask, and logits only where asked. At a few dozen tokens per sequence
  a row of 256 spends nearly all of its masked attention on pairs of tokens that may not attend to each other.
- ``decode``: one new token for each of ``B`` cache slots, attending to that
  slot's cached prefix of length ``positions[b]`` (per-slot lengths by masking).
- ``decode_versions``: the same decode for a batch whose rows belong to several
  policy versions (a multi-version engine), on weights stacked per version
  (``stack_versions``): batched matmuls over rows padded per version, and
  rotary, the KV cache and attention once for the whole batch. At this size a
  decode step is dominated by per-op overhead, so hosting more versions costs
  a few extra ops per step, not a forward per version.
"""


from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """Shape of the model; the same fields as the planner's model catalog entry."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 4
    """Must divide ``num_heads`` (grouped-query attention when smaller)."""
    head_dim: int = 16
    ffn_size: int = 256
    vocab_size: int = 64
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    """RMSNorm epsilon (the ``tiny-local`` preset's ``norm_eps``)."""
    mlp: Literal["gelu", "swiglu"] = "swiglu"
    """``swiglu``: ``down(silu(gate(x)) * up(x))`` without biases, gate and up in one matmul (``gate_up``, gate rows
    first), as the ``tiny-local`` preset prices it and Megatron trains it. ``gelu``: ``down(gelu(up(x)))`` with
    biases."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads({self.num_heads}) % num_kv_heads({self.num_kv_heads}) != 0; "
                "pick num_kv_heads dividing num_heads"
            )

    def num_params(self) -> int:
        """Parameter count: embeddings + layers (attention, MLP, 2 norms) + final norm (+ head)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * self.ffn_size if self.mlp == "swiglu" else 2 * h * self.ffn_size + self.ffn_size + h
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


class KVCache:
    """Preallocated keys/values: ``[layers, slots, kv_heads, max_len, head_dim]`` each.

    Slots are owned by the rollout engine; this object only holds memory.
    """

    def __init__(self, config: TinyModelConfig, *, num_slots: int, max_len: int) -> None:
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.max_len = max_len

    def read_slot(self, slot: int, length: int) -> torch.Tensor:
        """``[layers, 2, kv_heads, length, head_dim]`` copy of one slot's cached prefix."""
        return torch.stack([self.k[:, slot, :, :length], self.v[:, slot, :, :length]], dim=1).clone()

    def write_slot(self, slot: int, kv: torch.Tensor) -> None:
        length = kv.shape[3]
        self.k[:, slot, :, :length] = kv[:, 0]
        self.v[:, slot, :, :length] = kv[:, 1]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class _RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, spelled out: ``nn.RMSNorm`` costs ~80 us a call on CPU
    at this size (dtype round trips), several times the whole layer's matmuls."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of ``position * theta^(-2i/head_dim)`` for each channel pair ``i``: shape ``[*positions, d/2]``."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(x_i, x_{i + d/2})`` of ``x[..., head_dim]`` by the tabled angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@dataclass(frozen=True, kw_only=True)
class _DecodeContext:
    """Per-call tensors shared by every layer of one batched decode (computed once, not per layer)."""

    slots: torch.Tensor
    contiguous: slice | None
    length: int
    cos: torch.Tensor
    """``[B, 1, head_dim]``: ``cos`` of each channel pair's angle, on both of its channels."""
    sin: torch.Tensor
    """``[B, 1, head_dim]``: ``-sin`` on a pair's first channel, ``sin`` on its second (see ``_rotate_decode``)."""
    cache_rows: torch.Tensor
    """``[B * kv_heads]``: where each row's keys/values of this token go in one layer's cache seen as
    ``[slots * kv_heads * max_len, head_dim]``."""
    additive_mask: torch.Tensor
    """``[B, 1, 1, length]``: 0 where a slot's key is within its prefix, -inf beyond."""


class _Block(nn.Module):
    def __init__(self, c: TinyModelConfig) -> None:
        super().__init__()
        self.c = c
        self.attn_norm = _RMSNorm(c.hidden_size, c.norm_eps)
        # q, k and v in one matmul: at this size a decode step is dominated by per-op overhead.
        self.qkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = _RMSNorm(c.hidden_size, c.norm_eps)
        if c.mlp == "swiglu":
            self.gate_up = nn.Linear(c.hidden_size, 2 * c.ffn_size, bias=False)
            self.down = nn.Linear(c.ffn_size, c.hidden_size, bias=False)
        else:
            self.up = nn.Linear(c.hidden_size, c.ffn_size)
            self.down = nn.Linear(c.ffn_size, c.hidden_size)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp_norm(x)
        if self.c.mlp == "swiglu":
            gate, up = self.gate_up(h).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)
        return x + self.down(F.gelu(self.up(h)))

    def forward_rows(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [R, L, hidden]``, ``mask [R, 1, L, L]`` -> (output, k, v) with k/v ``[R, kv_heads, L, d]``."""
        c = self.c
        r, n, _ = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(r, n, c.num_heads + 2 * c.num_kv_heads, c.head_dim).transpose(1, 2)
        qk = _rotate(qkv[:, : c.num_heads + c.num_kv_heads], *rope)  # one rotation for q and k together
        q, k, v = qk[:, : c.num_heads], qk[:, c.num_heads :], qkv[:, c.num_heads + c.num_kv_heads :]
        group = c.num_heads // c.num_kv_heads
        kr = k.repeat_interleave(group, dim=1) if group > 1 else k
        vr = v.repeat_interleave(group, dim=1) if group > 1 else v
        out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        x = x + self.o(out.transpose(1, 2).reshape(r, n, c.num_heads * c.head_dim))
        return self._mlp(x), k, v

    def forward_sequences(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: SequenceLayout
    ) -> torch.Tensor:
        """``x [T, hidden]``: the flat tokens of whole sequences (see ``TinyTransformer.forward_sequences``)."""
        c = self.c
        qkv = self.qkv(self.attn_norm(x)).view(x.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        qk = _rotate(qkv[:, : c.num_heads + c.num_kv_heads], *rope)
        out = layout.attend(qk[:, : c.num_heads], qk[:, c.num_heads :], qkv[:, c.num_heads + c.num_kv_heads :])
        return self._mlp(x + self.o(out))

    def decode(self, x: torch.Tensor, cache: KVCache, layer: int, ctx: _DecodeContext) -> torch.Tensor:
        """``x [B, hidden]``: write this token's k/v at ``positions`` and attend to ``0..positions[b]``.

        The same operations as ``forward_rows`` on one token, calling ``F.linear`` and ``_rms`` directly (what the
        modules' ``forward`` runs): a module call costs a few microseconds, and a decode step makes 13 of them."""
        c = self.c
        h = _rms(x, self.attn_norm.weight, c.norm_eps)
        qkv = F.linear(h, self.qkv.weight).view(x.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        x = x + F.linear(_attend(c, qkv, cache, layer, ctx), self.o.weight)
        h = _rms(x, self.mlp_norm.weight, c.norm_eps)
        if c.mlp == "swiglu":
            gate, up = F.linear(h, self.gate_up.weight).chunk(2, dim=-1)
            return x + F.linear(F.silu(gate) * up, self.down.weight)
        return x + F.linear(F.gelu(F.linear(h, self.up.weight, self.up.bias)), self.down.weight, self.down.bias)


def _attend(
    c: TinyModelConfig, qkv: torch.Tensor, cache: KVCache, layer: int, ctx: _DecodeContext
) -> torch.Tensor:
    """``qkv [B, heads + 2 kv_heads, head_dim]`` of this token: rotate, write k/v at ``positions``, attend to
    ``0..positions[b]``; returns ``[B, heads * head_dim]``. No weights: shared by every version in a batch."""
    b = qkv.shape[0]
    group = c.num_heads // c.num_kv_heads
    qk = _rotate_decode(qkv[:, : c.num_heads + c.num_kv_heads], ctx.cos, ctx.sin)
    q, k, v = qk[:, : c.num_heads], qk[:, c.num_heads :], qkv[:, c.num_heads + c.num_kv_heads :]
    # One index_copy_ of B * kv_heads rows per tensor: the same writes as ``k[layer, slots, :, positions] = k``
    # without advanced indexing's per-call index building.
    cache.k[layer].view(-1, c.head_dim).index_copy_(0, ctx.cache_rows, k.reshape(-1, c.head_dim))
    cache.v[layer].view(-1, c.head_dim).index_copy_(0, ctx.cache_rows, v.reshape(-1, c.head_dim))
    # A contiguous slot range is read as a view; scattered slots need a gather, which copies.
    if ctx.contiguous is not None:
        keys = cache.k[layer, ctx.contiguous, :, : ctx.length]
        values = cache.v[layer, ctx.contiguous, :, : ctx.length]
    else:
        keys = cache.k[layer, :, :, : ctx.length].index_select(0, ctx.slots)
        values = cache.v[layer, :, :, : ctx.length].index_select(0, ctx.slots)
    qg = q.view(b, c.num_kv_heads, group, c.head_dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * (1.0 / math.sqrt(c.head_dim)) + ctx.additive_mask
    return torch.matmul(torch.softmax(scores, dim=-1), values).reshape(b, c.num_heads * c.head_dim)


def _rotate_decode(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``_rotate`` in three arithmetic ops instead of six, on ``_DecodeContext``'s doubled tables:
    ``x * [cos, cos] + [x2, x1] * [-sin, sin]``. Bit for bit the same: ``a - b`` is ``a + (-b)`` in IEEE
    arithmetic, and the second half only swaps the operands of an addition."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


@dataclass(frozen=True, kw_only=True)
class StackedVersions:
    """The weights of ``V`` versions stacked on a leading axis, for ``decode_versions`` (build: ``stack_versions``).

    Linear weights are stored transposed (``[V, in, out]``) for ``torch.baddbmm``; norm weights ``[V, h]``.
    """

    versions: int
    embed: torch.Tensor
    """``[V * vocab, hidden]``: version ``i``'s token ``t`` is row ``i * vocab + t``."""
    layers: tuple[dict[str, torch.Tensor], ...]
    norm: torch.Tensor
    head: torch.Tensor
    """``[V, hidden, vocab]``."""


def stack_versions(models: Sequence[TinyTransformer]) -> StackedVersions:
    """Stack the weights of ``models`` (same config) for a multi-version decode. Copies them (~V x weights)."""
    config = models[0].config
    if any(m.config != config for m in models):
        raise ValueError("stack_versions needs models of one configuration")

    def t(get: Callable[[TinyTransformer], torch.Tensor]) -> torch.Tensor:
        return torch.stack([get(m).detach() for m in models])

    layers = []
    for i in range(config.num_layers):
        def blk(m: TinyTransformer, i: int = i) -> _Block:
            return m.layers[i]  # type: ignore[return-value]
        weights = {
            "attn_norm": t(lambda m: blk(m).attn_norm.weight),
            "qkv": t(lambda m: blk(m).qkv.weight.T),
            "o": t(lambda m: blk(m).o.weight.T),
            "mlp_norm": t(lambda m: blk(m).mlp_norm.weight),
            "down": t(lambda m: blk(m).down.weight.T),
        }
        if config.mlp == "swiglu":
            weights["gate_up"] = t(lambda m: blk(m).gate_up.weight.T)
        else:
            weights.update(up=t(lambda m: blk(m).up.weight.T), up_bias=t(lambda m: blk(m).up.bias[None]),
                           down_bias=t(lambda m: blk(m).down.bias[None]))
        layers.append(weights)
    head = t(lambda m: m.embed.weight.T if m.lm_head is None else m.lm_head.weight.T)
    return StackedVersions(
        versions=len(models), embed=t(lambda m: m.embed.weight).reshape(-1, config.hidden_size),
        layers=tuple(layers), norm=t(lambda m: m.norm.weight), head=head.contiguous(),
    )


class _Padded:
    """Moves rows between batch order ``[B, d]`` and per-version padded order ``[V, Bmax, d]`` (for bmm)."""

    def __init__(self, version_index: torch.Tensor, versions: int) -> None:
        counts = torch.bincount(version_index, minlength=versions)
        order = torch.argsort(version_index, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.shape[0]) - starts[version_index[order]]
        self.width = int(counts.max())
        self.dest = version_index * self.width + rank
        self.versions = versions

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((self.versions * self.width, x.shape[-1]))
        return out.index_copy_(0, self.dest, x).view(self.versions, self.width, x.shape[-1])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(self.versions * self.width, y.shape[-1]).index_select(0, self.dest)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


@dataclass(frozen=True, kw_only=True)
class SequenceLayout:
    """How ``T`` flat tokens of whole sequences (each contiguous, its positions ``0..n-1``) are attended: sequences
    of similar length (the same power of two rounding up) are padded to the longest of them and attended together,
    causally, in one ``[S, heads, width, head_dim]`` batch (fewer batches would pad more, more would cost a call
    each). Build with ``sequence_layout``.

    A padding slot repeats its sequence's last token. Causal attention never lets a real token see a later slot,
    so those copies get zero attention weight and zero gradient, and their own outputs are dropped."""

    buckets: tuple[tuple[torch.Tensor, int], ...]
    """``(gather, width)`` per width: ``gather [S * width]`` indexes the flat tokens, sequence by sequence."""
    scatter: torch.Tensor
    """``[T]``: where each token's output sits in the buckets' outputs, concatenated."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, heads, d]``, ``k, v [T, kv_heads, d]`` -> ``[T, heads * d]``: each token attends to its own
        sequence's tokens up to itself."""
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        group = heads // kv_heads
        outs = []
        for gather, width in self.buckets:
            def batched(x: torch.Tensor, gather: torch.Tensor = gather, width: int = width) -> torch.Tensor:
                return x.index_select(0, gather).view(-1, width, x.shape[1], d).transpose(1, 2)

            kb, vb = batched(k), batched(v)
            if group > 1:
                kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(batched(q), kb, vb, is_causal=True)
            outs.append(out.transpose(1, 2).reshape(-1, heads * d))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, self.scatter)


def sequence_layout(position_ids: torch.Tensor) -> SequenceLayout:
    """The ``SequenceLayout`` of flat tokens whose ``position_ids [T]`` restart at 0 at each sequence's first."""
    t = position_ids.shape[0]
    starts = (position_ids == 0).nonzero().squeeze(1)
    lengths = torch.diff(starts, append=torch.tensor([t]))
    classes = torch.ceil(torch.log2(lengths.double())).long()  # lengths in (2^(c-1), 2^c] share a bucket
    scatter = torch.empty(t, dtype=torch.int64)
    buckets, base = [], 0
    for c in sorted(set(classes.tolist())):
        members = (classes == c).nonzero().squeeze(1)
        width = int(lengths[members].max())
        offsets = torch.arange(width)
        within = offsets[None, :] < lengths[members, None]  # [S, width]: real slots
        gather = starts[members, None] + torch.minimum(offsets[None, :], lengths[members, None] - 1)
        scatter[gather[within]] = base + within.reshape(-1).nonzero().squeeze(1)
        buckets.append((gather.reshape(-1), width))
        base += gather.numel()
    return SequenceLayout(buckets=tuple(buckets), scatter=scatter)


def packed_attention_mask(position_ids: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` bool, True where token ``i`` may attend to token ``j``: same segment and
    ``position_ids[j] <= position_ids[i]``; segment ``-1`` (row padding) attends only to itself, so no softmax
    row is empty."""
    n = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = position_ids[:, None, :] <= position_ids[:, :, None]
    eye = torch.eye(n, dtype=torch.bool, device=segment_ids.device)
    return ((same & causal & (segment_ids[:, None, :] >= 0)) | eye)[:, None]


class TinyTransformer(nn.Module):
    """The policy. See the module docstring for the architecture."""

    def __init__(self, config: TinyModelConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = _RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = (
            None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    # Residual-branch outputs are scaled down by depth (GPT-2 style) so a random
                    # start has unit-scale activations.
                    std = 0.02 / math.sqrt(2 * config.num_layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                elif name.endswith("bias"):
                    p.zero_()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)

    def forward_rows(
        self,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        *,
        cache: KVCache | None = None,
        cache_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[R, L, vocab]`` for rows of packed sequences.

        Token ``i`` attends to token ``j`` iff both have the same segment id and
        ``position_ids[j] <= position_ids[i]``; segment id ``-1`` marks row padding
        (it attends only to itself so no softmax row is empty). With ``cache``,
        row ``r`` is one sequence whose keys/values go to ``cache_slots[r]``.
        """
        n = token_ids.shape[1]
        mask = packed_attention_mask(position_ids, segment_ids)
        x = self.embed(token_ids)
        cos, sin = _rotary_tables(position_ids[:, None, :], self.config.head_dim, self.config.rope_theta)
        for i, layer in enumerate(self.layers):
            # torch types ModuleList items as Module (attribute access -> Tensor | Module); these are _Block
            x, k, v = layer.forward_rows(x, (cos, sin), mask)  # type: ignore[operator]
            if cache is not None:
                assert cache_slots is not None
                idx = torch.tensor(cache_slots)
                cache.k[i, idx, :, :n] = k
                cache.v[i, idx, :, :n] = v
        return self._logits(x)

    def forward_sequences(
        self, token_ids: torch.Tensor, position_ids: torch.Tensor, logit_index: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[N, vocab]`` at flat positions ``logit_index [N]`` of ``token_ids [T]``: whole sequences laid
        end to end, ``position_ids [T]`` restarting at 0 at each. The same logits as ``forward_rows`` on the same
        sequences packed in rows (up to float rounding), without computing the rows' padding, the attention
        between tokens of different sequences, or logits nobody reads."""
        x = self.embed(token_ids)
        rope = _rotary_tables(position_ids[:, None], self.config.head_dim, self.config.rope_theta)
        layout = sequence_layout(position_ids)
        for layer in self.layers:
            x = layer.forward_sequences(x, rope, layout)  # type: ignore[operator]  # ModuleList item: a _Block
        return self._logits(x.index_select(0, logit_index))  # the final norm is per token: select first

    def decode(
        self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` for one new token per slot; ``positions[b]`` = cached length of ``slots[b]``."""
        ctx = _decode_context(self.config, positions, slots, cache)
        x = F.embedding(token_ids, self.embed.weight)
        for i, layer in enumerate(self.layers):
            x = layer.decode(x, cache, i, ctx)  # type: ignore[operator]  # ModuleList item typed Module; a _Block
        x = _rms(x, self.norm.weight, self.config.norm_eps)
        return x @ self.embed.weight.T if self.lm_head is None else F.linear(x, self.lm_head.weight)


def _decode_context(
    config: TinyModelConfig, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache
) -> _DecodeContext:
    first, count = int(slots[0]), slots.shape[0]
    contiguous = (
        slice(first, first + count)
        if int(slots[-1]) == first + count - 1 and bool((slots.diff() == 1).all())
        else None
    )
    length = int(positions.max()) + 1
    beyond = torch.arange(length)[None, :] > positions[:, None]
    cos, sin = _rotary_tables(positions[:, None], config.head_dim, config.rope_theta)
    heads = torch.arange(config.num_kv_heads)
    cache_rows = ((slots[:, None] * config.num_kv_heads + heads) * cache.max_len + positions[:, None]).reshape(-1)
    return _DecodeContext(
        slots=slots, contiguous=contiguous, length=length, cache_rows=cache_rows,
        cos=torch.cat([cos, cos], dim=-1), sin=torch.cat([-sin, sin], dim=-1),
        additive_mask=torch.zeros(beyond.shape).masked_fill_(beyond, float("-inf"))[:, None, None, :],
    )


@torch.no_grad()
def decode_versions(
    config: TinyModelConfig, stacked: StackedVersions, version_index: torch.Tensor, token_ids: torch.Tensor,
    positions: torch.Tensor, cache: KVCache, slots: torch.Tensor,
) -> torch.Tensor:
    """``TinyTransformer.decode`` for a batch mixing versions: row ``b`` uses version ``version_index[b]`` of
    ``stacked``. Each row's logits equal its own version's ``decode`` (same maths, up to float rounding).

    Only what holds weights runs per version, and all versions at once: the embedding is one lookup in the
    stacked table, each linear one ``baddbmm`` over rows padded per version (``[V, Bmax, d]``), norms scale by
    a per-row weight. Rotary, the cache and attention run once over the batch. So a step costs about one
    single-version step plus a pad/unpad per linear, however many versions are hosted.
    """
    c = config
    n = stacked.versions
    ctx = _decode_context(c, positions, slots, cache)
    rows = _Padded(version_index, n)
    b = token_ids.shape[0]
    x = F.embedding(version_index * c.vocab_size + token_ids, stacked.embed)
    for i, w in enumerate(stacked.layers):
        h = _rms(x, w["attn_norm"][version_index], c.norm_eps)
        qkv = rows.unpad(torch.bmm(rows.pad(h), w["qkv"])).view(b, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        x = x + rows.unpad(torch.bmm(rows.pad(_attend(c, qkv, cache, i, ctx)), w["o"]))
        h = rows.pad(_rms(x, w["mlp_norm"][version_index], c.norm_eps))
        if c.mlp == "swiglu":
            gate, up = torch.bmm(h, w["gate_up"]).chunk(2, dim=-1)
            x = x + rows.unpad(torch.bmm(F.silu(gate) * up, w["down"]))
        else:
            x = x + rows.unpad(torch.baddbmm(w["down_bias"], F.gelu(torch.baddbmm(w["up_bias"], h, w["up"])), w["down"]))
    return rows.unpad(torch.bmm(rows.pad(_rms(x, stacked.norm[version_index], c.norm_eps)), stacked.head))


def export_weights(model: TinyTransformer) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies of the parameters (safe to put in Ray's object store)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def model_from_weights(config: TinyModelConfig, weights: dict[str, torch.Tensor]) -> TinyTransformer:
    model = TinyTransformer(config)
    model.load_state_dict(weights)
    model.requires_grad_(False)
    return model.eval()


def hf_weights(model_weights: dict[str, torch.Tensor], config: TinyModelConfig) -> dict[str, torch.Tensor]:
    """A ``swiglu`` model's weights (``export_weights``) under the checkpoint's (Hugging Face Llama) names, which
    the Megatron trainer's ``megatron_weights`` reads: ``qkv`` -> ``q_proj``/``k_proj``/``v_proj``, ``gate_up``
    -> ``gate_proj``/``up_proj``, norms and embeddings renamed. ``tiny_weights`` is the inverse."""
    if config.mlp != "swiglu":
        raise ValueError("only a swiglu model has checkpoint (Hugging Face) names; this one's MLP is gelu")
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"model.embed_tokens.weight": model_weights["embed.weight"], "model.norm.weight": model_weights["norm.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = model_weights["lm_head.weight"]
    for i in range(config.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"], out[h + "self_attn.v_proj.weight"] = (
            model_weights[t + "qkv.weight"].split([q, kv, kv]))
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = model_weights[t + "gate_up.weight"].chunk(2)
        out.update({h + "input_layernorm.weight": model_weights[t + "attn_norm.weight"],
                    h + "self_attn.o_proj.weight": model_weights[t + "o.weight"],
                    h + "post_attention_layernorm.weight": model_weights[t + "mlp_norm.weight"],
                    h + "mlp.down_proj.weight": model_weights[t + "down.weight"]})
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def tiny_weights(hf: dict[str, torch.Tensor], config: TinyModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_weights``: checkpoint names -> this model's state dict. A missing name raises KeyError;
    one the model does not use, ValueError."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    used = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
        used.add("lm_head.weight")
    for i in range(config.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        names = {p: h + p for p in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                   "mlp.gate_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight",
                                   "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                   "mlp.down_proj.weight")}
        used.update(names.values())
        w = {p: hf[name] for p, name in names.items()}
        out[t + "qkv.weight"] = torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"],
                                           w["self_attn.v_proj.weight"]])
        out[t + "gate_up.weight"] = torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])
        out.update({t + "attn_norm.weight": w["input_layernorm.weight"], t + "o.weight": w["self_attn.o_proj.weight"],
                    t + "mlp_norm.weight": w["post_attention_layernorm.weight"],
                    t + "down.weight": w["mlp.down_proj.weight"]})
    unused = sorted(set(hf) - used)
    if unused:
        raise ValueError(f"checkpoint weights this model does not use: {unused[:4]}")
    return out
