"""The tiny transformer: cached decode and packed rows compute the same logits as a plain forward."""

import dataclasses
import math

import pytest
import torch

from dora.runtime.engines.tiny_model import (
    KVCache,
    TinyModelConfig,
    TinyTransformer,
    _rotary_tables,
    _rotate,
    decode_versions,
    export_weights,
    model_from_weights,
    sequence_layout,
    stack_versions,
)

torch.set_num_threads(1)

CONFIGS = {
    "mha": TinyModelConfig(vocab_size=32, num_layers=2),
    "gqa": TinyModelConfig(vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2),
    "untied": TinyModelConfig(vocab_size=32, num_layers=1, tie_embeddings=False),
    "eps-theta": TinyModelConfig(vocab_size=32, num_layers=1, norm_eps=0.5, rope_theta=500.0),
    "swiglu": TinyModelConfig(vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2, tie_embeddings=False,
                              mlp="swiglu"),
    "gelu": TinyModelConfig(vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp="gelu"),
}


def test_the_tiny_local_preset_describes_this_model() -> None:
    from planner.architecture import get_preset

    tiny, config = get_preset("tiny-local"), TinyModelConfig()
    assert (tiny.rope_theta, tiny.norm_eps) == (config.rope_theta, config.norm_eps)
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.head_dim) == (
        config.num_layers, config.hidden_size, config.num_heads, config.head_dim)


def test_norm_epsilon_and_rope_base_change_the_logits() -> None:
    tokens = [1, 5, 7, 3, 2]
    base = _full_logits(TinyTransformer(CONFIGS["mha"], seed=3), tokens)
    for change in ({"norm_eps": 0.5}, {"rope_theta": 500.0}):
        other = dataclasses.replace(CONFIGS["mha"], **change)
        assert not torch.allclose(_full_logits(TinyTransformer(other, seed=3), tokens), base, atol=1e-4)


def _full_logits(model: TinyTransformer, tokens: list[int]) -> torch.Tensor:
    t = torch.tensor([tokens])
    return model.forward_rows(t, torch.arange(len(tokens))[None], torch.zeros_like(t))[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_matches_full_forward(name: str) -> None:
    config = CONFIGS[name]
    model = model_from_weights(config, export_weights(TinyTransformer(config, seed=3)))
    gen = torch.Generator().manual_seed(0)
    # Three sequences of different lengths, decoded together from slots 0, 2, 3 of a 4-slot cache
    # (scattered slots exercise the gather path; a contiguous run the view path below).
    seqs = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (5, 9, 14)]
    prompt_len = 3
    with torch.no_grad():
        for slots in ([0, 2, 3], [1, 2, 3]):
            cache = KVCache(config, num_slots=4, max_len=16)
            for s, seq in zip(slots, seqs, strict=True):
                t = torch.tensor([seq[:prompt_len]])
                model.forward_rows(t, torch.arange(prompt_len)[None], torch.zeros_like(t), cache=cache, cache_slots=[s])
            # Step all three together until the shortest is done, then the others alone.
            for pos in range(prompt_len, 14):
                live = [i for i, seq in enumerate(seqs) if pos < len(seq)]
                logits = model.decode(
                    torch.tensor([seqs[i][pos] for i in live]), torch.tensor([pos] * len(live)), cache,
                    torch.tensor([slots[i] for i in live]),
                )
                for row, i in enumerate(live):
                    expected = _full_logits(model, seqs[i])[pos]
                    torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=0)


def test_decode_with_per_slot_lengths() -> None:
    """Slots at different positions in one batch: each attends only to its own prefix."""
    config = CONFIGS["gqa"]
    model = TinyTransformer(config, seed=1).eval()
    a, b = [1, 2, 3, 4, 5, 6, 7], [8, 9, 10]
    cache = KVCache(config, num_slots=2, max_len=8)
    with torch.no_grad():
        for slot, seq in ((0, a[:-1]), (1, b[:-1])):
            t = torch.tensor([seq])
            model.forward_rows(t, torch.arange(len(seq))[None], torch.zeros_like(t), cache=cache, cache_slots=[slot])
        logits = model.decode(torch.tensor([a[-1], b[-1]]), torch.tensor([6, 2]), cache, torch.tensor([0, 1]))
        torch.testing.assert_close(logits[0], _full_logits(model, a)[-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[1], _full_logits(model, b)[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_multi_version_decode_matches_each_versions_own_decode(name: str) -> None:
    """Rows of three versions decoded in one pass get exactly their own version's logits and cache entries."""
    config = CONFIGS[name]
    models = [TinyTransformer(config, seed=s).eval() for s in (1, 2, 3)]
    gen = torch.Generator().manual_seed(5)
    owner = [2, 0, 1, 0, 2, 1]  # row -> version (interleaved, so the per-version rows are scattered)
    prefixes = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (4, 7, 2, 9, 5, 3)]
    new_tokens = torch.randint(0, 32, (6,), generator=gen)
    positions = torch.tensor([len(p) for p in prefixes])
    with torch.no_grad():
        for slots in (torch.arange(6), torch.tensor([5, 0, 3, 1, 4, 2])):
            cache = KVCache(config, num_slots=6, max_len=12)
            for row, (v, p) in enumerate(zip(owner, prefixes, strict=True)):
                t = torch.tensor([p])
                models[v].forward_rows(t, torch.arange(len(p))[None], torch.zeros_like(t), cache=cache,
                                       cache_slots=[int(slots[row])])
            logits = decode_versions(config, stack_versions(models), torch.tensor(owner), new_tokens, positions,
                                     cache, slots)
            for row, v in enumerate(owner):
                expected = _full_logits(models[v], [*prefixes[row], int(new_tokens[row])])[-1]
                torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="one configuration"):
        stack_versions([models[0], TinyTransformer(CONFIGS["gqa" if name != "gqa" else "mha"])])


def _reference_decode(model: TinyTransformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      slots: torch.Tensor) -> torch.Tensor:
    """``decode`` as first written (module calls, six-op rotation, advanced-index cache writes, slots gathered)."""
    c = model.config
    cos, sin = _rotary_tables(positions[:, None], c.head_dim, c.rope_theta)
    length = int(positions.max()) + 1
    beyond = torch.arange(length)[None, :] > positions[:, None]
    mask = torch.zeros(beyond.shape).masked_fill_(beyond, float("-inf"))[:, None, None, :]
    x = model.embed(tokens)
    for i, layer in enumerate(model.layers):
        qkv = layer.qkv(layer.attn_norm(x)).view(x.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        qk = _rotate(qkv[:, : c.num_heads + c.num_kv_heads], cos, sin)
        q, k, v = qk[:, : c.num_heads], qk[:, c.num_heads :], qkv[:, c.num_heads + c.num_kv_heads :]
        cache.k[i, slots, :, positions] = k
        cache.v[i, slots, :, positions] = v
        keys = cache.k[i, :, :, :length].index_select(0, slots)
        values = cache.v[i, :, :, :length].index_select(0, slots)
        qg = q.view(x.shape[0], c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * (1.0 / math.sqrt(c.head_dim)) + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), values).reshape(x.shape[0], c.num_heads * c.head_dim)
        x = layer._mlp(x + layer.o(out))
    return model._logits(x)


@pytest.mark.parametrize("name", CONFIGS)
def test_decode_is_bit_identical_to_the_reference_decode(name: str) -> None:
    """The decode fast path (direct F.linear, three-op rotation, index_copy_ cache writes) changes no bit of the
    logits or the cache, on scattered and on contiguous slots."""
    config = CONFIGS[name]
    model = TinyTransformer(config, seed=3).eval()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 6, config.head_dim, generator=gen)
    cos, sin = _rotary_tables(torch.randint(0, 50, (5, 1), generator=gen), config.head_dim, config.rope_theta)
    assert torch.equal(_rotate(x, cos, sin),
                       x * torch.cat([cos, cos], -1) + torch.cat([x[..., config.head_dim // 2:],
                                                                  x[..., : config.head_dim // 2]], -1)
                       * torch.cat([-sin, sin], -1))
    for slots in (torch.arange(2, 8), torch.tensor([5, 0, 7, 1, 4, 2])):
        caches = [KVCache(config, num_slots=8, max_len=12) for _ in range(2)]
        for cache in caches:
            cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
            cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
        tokens = torch.randint(0, config.vocab_size, (6,), generator=gen)
        positions = torch.randint(0, 11, (6,), generator=gen)
        with torch.inference_mode():
            got = model.decode(tokens, positions, caches[0], slots)
            expected = _reference_decode(model, tokens, positions, caches[1], slots)
        assert torch.equal(got, expected)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_packed_rows_match_separate_forwards() -> None:
    config = CONFIGS["mha"]
    model = TinyTransformer(config, seed=2).eval()
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    tokens = torch.tensor([sum(seqs, []) + [0, 0]])  # two tail padding tokens
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 0]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, -1, -1]])
    with torch.no_grad():
        packed = model.forward_rows(tokens, positions, segments)[0]
        offset = 0
        for seq in seqs:
            torch.testing.assert_close(packed[offset : offset + len(seq)], _full_logits(model, seq), atol=1e-5, rtol=0)
            offset += len(seq)
    assert torch.isfinite(packed).all()


def test_sequence_layout_buckets_by_power_of_two_and_scatters_every_token_back() -> None:
    lengths = [1, 3, 4, 5, 9, 2, 16, 17]
    positions = torch.cat([torch.arange(n) for n in lengths])
    layout = sequence_layout(positions)
    # classes (2^(c-1), 2^c]: {1}, {2}, {3, 4}, {5}, {9, 16}, {17}; each padded to its longest member
    assert [(len(g) // w, w) for g, w in layout.buckets] == [(1, 1), (1, 2), (2, 4), (1, 5), (2, 16), (1, 17)]
    gathered = torch.cat([g for g, _ in layout.buckets])
    assert torch.equal(gathered[layout.scatter], torch.arange(len(positions)))  # each token comes back to itself


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_sequences_equals_packed_rows_in_values_and_gradients(name: str) -> None:
    """The training forward (flat sequences, attention per sequence batched by length, logits only where asked)
    against ``forward_rows`` on the same sequences packed into rows with a block-diagonal mask."""
    config = CONFIGS[name]
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 2, 3, 5, 8, 8, 13, 21, 4, 30]
    rows = [[0, 3, 5, 8], [1, 2, 4, 6, 7], [9]]  # sequence indices per row; the rows' tails are padding
    width = max(sum(lengths[i] for i in row) for row in rows) + 2
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    positions = torch.zeros_like(tokens)
    segments = torch.full_like(tokens, -1)
    flat_at, row_at = [], []  # per sequence: where its tokens sit in the flat order and in the rows
    flat = 0
    for r, row in enumerate(rows):
        offset = 0
        for seg, i in enumerate(row):
            n = lengths[i]
            tokens[r, offset : offset + n], positions[r, offset : offset + n] = seqs[i], torch.arange(n)
            segments[r, offset : offset + n] = seg
            flat_at.append(torch.arange(flat, flat + n))
            row_at.append(torch.arange(r * width + offset, r * width + offset + n))
            offset, flat = offset + n, flat + n
    pick = torch.randperm(flat, generator=gen)[: flat // 2]  # logits at some positions, in any order
    real = segments.reshape(-1) >= 0
    model = TinyTransformer(config, seed=4)
    new = model.forward_sequences(tokens.reshape(-1)[real], positions.reshape(-1)[real], torch.cat(flat_at)[pick])
    old = model.forward_rows(tokens, positions, segments).reshape(-1, config.vocab_size)[torch.cat(row_at)[pick]]
    torch.testing.assert_close(new, old, atol=1e-5, rtol=0)
    weights = torch.randn(old.shape, generator=gen)
    grads_new = torch.autograd.grad((new * weights).sum(), list(model.parameters()))
    grads_old = torch.autograd.grad((old * weights).sum(), list(model.parameters()))
    for (param, _), a, b in zip(model.named_parameters(), grads_new, grads_old, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, param=param: f"{param}: {m}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_num_params_counts_the_module(name: str) -> None:
    config = CONFIGS[name]
    assert config.num_params() == sum(p.numel() for p in TinyTransformer(config).parameters())


def test_weights_round_trip_and_are_plain_cpu_tensors() -> None:
    config = CONFIGS["untied"]
    weights = export_weights(TinyTransformer(config, seed=5))
    assert all(t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad for t in weights.values())
    clone = model_from_weights(config, weights)
    for key, value in clone.state_dict().items():
        assert torch.equal(value, weights[key])


def test_kv_heads_must_divide_heads() -> None:
    with pytest.raises(ValueError, match=r"num_heads\(4\) % num_kv_heads\(3\)"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)


@pytest.mark.parametrize("tied", [True, False])
def test_a_swiglu_models_checkpoint_names_round_trip(tied: bool) -> None:
    from dora.runtime.engines.tiny_model import hf_weights, tiny_weights

    config = dataclasses.replace(CONFIGS["swiglu"], tie_embeddings=tied)
    weights = export_weights(TinyTransformer(config, seed=4))
    hf = hf_weights(weights, config)
    assert ("lm_head.weight" in hf) is not tied
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # 2 kv heads of 16
    back = tiny_weights(hf, config)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    with pytest.raises(ValueError, match="does not use"):
        tiny_weights({**hf, "model.layers.9.mlp.up_proj.weight": hf["model.layers.0.mlp.up_proj.weight"]}, config)
    with pytest.raises(ValueError, match="gelu"):
        hf_weights(export_weights(TinyTransformer(CONFIGS["gelu"])), CONFIGS["gelu"])
