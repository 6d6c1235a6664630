"""The CPU rollout engine: batching, abort/resume, migration and multi-version hosting change no token.

Every test runs twice: prompts prefilled by a forward of their own (``decode_ingest_max_tokens=0``), and
prompts ingested one token per step inside the decode batch (the default for short prompts).
"""

import dataclasses
import threading

import pytest
import torch

from dora.runtime.engines.base import FinishedTrajectory, GenerationRequest, RolloutEngine
from dora.runtime.engines.sampling import (
    _MASK32,
    _mix32,
    noise_key,
    sample_keyed,
    sample_tokens,
    uniform_noise,
)
from dora.runtime.engines.tiny_model import TinyModelConfig, TinyTransformer, export_weights
from dora.runtime.engines.torch_rollout import RolloutConfig, TorchRolloutEngine

torch.set_num_threads(1)

MODEL = TinyModelConfig(vocab_size=24, num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16, ffn_size=64)
EOS = 1
W0 = export_weights(TinyTransformer(MODEL, seed=0))
W1 = export_weights(TinyTransformer(MODEL, seed=1))


INGEST = {"ingest": 8}


@pytest.fixture(autouse=True, params=[0, 8], ids=["prefill", "ingest"])
def _ingest_mode(request: pytest.FixtureRequest) -> None:
    INGEST["ingest"] = request.param


def _engine(max_num_seqs: int = 8, **versions: dict[str, torch.Tensor]) -> TorchRolloutEngine:
    engine = TorchRolloutEngine(RolloutConfig(model=MODEL, eos_token_id=EOS, max_num_seqs=max_num_seqs, max_model_len=40,
                                              decode_ingest_max_tokens=INGEST["ingest"]))
    for name, weights in (versions or {"v0": W0}).items():
        engine.load_weights(int(name[1:]), weights)
    return engine


def _request(i: int, version: int = 0, max_new_tokens: int = 30, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{i}", prompt_ids=(0, 2 + i % 7, 3 + i % 5, 2 + i % 3)[: 2 + i % 3], version=version,
        max_new_tokens=max_new_tokens, seed=1000 + i, **kw,
    )


def _drain(engine: TorchRolloutEngine) -> dict[str, FinishedTrajectory]:
    done: dict[str, FinishedTrajectory] = {}
    while engine.num_active() or engine.num_waiting():
        for t in engine.step():
            assert t.request_id not in done
            done[t.request_id] = t
    return done


def _step_until_generated(engine: TorchRolloutEngine, tokens: int) -> None:
    """Step until the engine generated ``tokens`` in total (prompt ingestion takes steps too), finishing nothing."""
    while engine.stats().generated_tokens < tokens:
        assert engine.step() == []


def _run_alone(request: GenerationRequest, weights: dict[str, torch.Tensor]) -> FinishedTrajectory:
    engine = _engine(1, **{f"v{request.version}": weights})
    engine.add_request(request)
    return _drain(engine)[request.request_id]


def test_engine_satisfies_protocol() -> None:
    assert isinstance(_engine(), RolloutEngine)


def test_continuous_batching_matches_one_at_a_time() -> None:
    requests = [_request(i) for i in range(12)]
    engine = _engine(max_num_seqs=5)  # fewer slots than requests: admission mid-flight
    for r in requests:
        engine.add_request(r)
    batched = _drain(engine)
    assert len(batched) == 12 and engine.num_active() == 0
    lengths = {len(t.response_ids) for t in batched.values()}
    assert len(lengths) > 2, "test needs sequences finishing at different steps"
    for r in requests:
        alone = _run_alone(r, W0)
        assert batched[r.request_id].response_ids == alone.response_ids
        torch.testing.assert_close(
            torch.tensor(batched[r.request_id].behaviour_logprobs), torch.tensor(alone.behaviour_logprobs),
            atol=1e-5, rtol=0,
        )


def test_behaviour_logprobs_are_those_of_the_sampling_distribution() -> None:
    r = _request(3, temperature=0.7)
    t = _run_alone(r, W0)
    model = TinyTransformer(MODEL)
    model.load_state_dict(W0)
    tokens = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
    with torch.no_grad():
        logits = model.forward_rows(tokens, torch.arange(tokens.shape[1])[None], torch.zeros_like(tokens))[0]
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    p = len(t.prompt_ids)
    expected = [float(logp[p - 1 + i, tok]) for i, tok in enumerate(t.response_ids)]
    torch.testing.assert_close(torch.tensor(t.behaviour_logprobs), torch.tensor(expected), atol=1e-5, rtol=0)
    assert t.version_spans == ((0, len(t.response_ids)),)


def test_finish_reasons() -> None:
    engine = _engine()
    for i in range(8):
        engine.add_request(_request(i, max_new_tokens=6))
    done = _drain(engine).values()
    for t in done:
        assert len(t.response_ids) <= 6
        if t.finish_reason == "stop":
            assert t.response_ids[-1] == EOS and EOS not in t.response_ids[:-1]
        else:
            assert len(t.response_ids) == 6 and EOS not in t.response_ids
    stats = engine.stats()
    assert stats.generated_tokens == sum(len(t.response_ids) for t in done)
    assert stats.finished == 8 and stats.num_active == 0


def test_abort_then_resume_on_same_version_is_identical() -> None:
    r = _request(4)
    reference = _run_alone(r, W0)
    assert len(reference.response_ids) > 6
    engine = _engine()
    engine.add_request(r)
    _step_until_generated(engine, 5)
    partial = engine.abort(r.request_id)
    assert partial is not None and engine.num_active() == 0 and engine.abort(r.request_id) is None
    assert partial.response_ids == reference.response_ids[:5]
    assert partial.behaviour_logprobs == pytest.approx(reference.behaviour_logprobs[:5], abs=1e-6)
    resumed = _run_alone(GenerationRequest(**{**r.__dict__, "prefix": partial}), W0)
    assert resumed.response_ids == reference.response_ids
    assert resumed.behaviour_logprobs == pytest.approx(reference.behaviour_logprobs, abs=1e-5)
    assert resumed.version_spans == ((0, len(reference.response_ids)),)


def test_resume_on_new_version_records_spans_and_keeps_old_logprobs() -> None:
    r = _request(5)
    engine = _engine()
    engine.add_request(r)
    _step_until_generated(engine, 4)
    partial = engine.abort(r.request_id)
    assert partial is not None
    resumed = _run_alone(GenerationRequest(**{**r.__dict__, "version": 1, "prefix": partial}), W1)
    assert resumed.response_ids[:4] == partial.response_ids
    assert resumed.behaviour_logprobs[:4] == partial.behaviour_logprobs
    assert resumed.version_spans == ((0, 4), (1, len(resumed.response_ids) - 4))
    assert resumed.version == 0  # staleness is measured from the oldest span


def test_a_request_interrupted_before_its_first_token_keeps_its_version_on_the_record() -> None:
    # aborted while it waited (no token yet) and resumed on v1: every token is v1's, but the trace's checker holds
    # a trajectory to the version it was admitted on, so the record starts with an empty span of v0 (the simulator
    # records the same), and staleness is measured from v0, the version the policy admitted it on
    r = _request(6)
    engine = _engine()
    engine.add_request(r)
    partial = engine.abort(r.request_id)
    assert partial is not None and partial.response_ids == () and partial.version_spans == ((0, 0),)
    resumed = _run_alone(GenerationRequest(**{**r.__dict__, "version": 1, "prefix": partial}), W1)
    assert resumed.version_spans == ((0, 0), (1, len(resumed.response_ids)))
    assert resumed.version == 0


def test_export_import_migration_continues_identically() -> None:
    requests = [_request(i) for i in range(6)]
    reference = {r.request_id: _run_alone(r, W0) for r in requests}
    source, target = _engine(max_num_seqs=4), _engine(max_num_seqs=4)
    for r in requests:
        source.add_request(r)
    finished = {}
    for _ in range(3):
        finished.update({t.request_id: t for t in source.step()})
    # Move two active sequences (with their caches) and one still-waiting request.
    moving = [*[rid for rid in source.active_request_ids() if rid not in finished][:2], "r5"]
    for rid in moving:
        target.import_request(source.export_request(rid))
    finished.update(_drain(source))
    finished.update(_drain(target))
    assert set(finished) == set(reference)
    for rid, t in finished.items():
        assert t.response_ids == reference[rid].response_ids, rid
        assert t.behaviour_logprobs == pytest.approx(reference[rid].behaviour_logprobs, abs=1e-5)


def test_multi_version_engine_routes_each_sequence_to_its_weights() -> None:
    requests = [_request(i, version=i % 2) for i in range(10)]
    engine = _engine(max_num_seqs=6, v0=W0, v1=W1)
    for r in requests:
        engine.add_request(r)
    done = _drain(engine)
    for r in requests:
        alone = _run_alone(r, W0 if r.version == 0 else W1)
        assert done[r.request_id].response_ids == alone.response_ids
        assert done[r.request_id].version_spans == ((r.version, len(alone.response_ids)),)
    # The same requests on the other version's weights generate something else: routing matters.
    swapped = [_run_alone(GenerationRequest(**{**r.__dict__, "version": 1 - r.version}), W0 if r.version else W1)
               for r in requests]
    assert any(s.response_ids != done[s.request_id].response_ids for s in swapped)
    # Both versions share one batched pass per step (per-version weights, shared attention and sampling).
    assert engine.stats().decode_forwards <= engine.stats().steps


def test_version_lifecycle_errors() -> None:
    engine = _engine()
    with pytest.raises(ValueError, match=r"wants version 3, engine hosts \(0,\)"):
        engine.add_request(_request(0, version=3))
    engine.add_request(_request(0))
    assert [r.request_id for r in engine.in_flight_requests()] == ["r0"] and engine.num_waiting() == 1
    with pytest.raises(RuntimeError, match="cannot drop version 0: 1 requests"):
        engine.drop_version(0)
    with pytest.raises(RuntimeError, match="cannot replace version 0's weights: 1 requests use it"):
        engine.load_weights(0, W1)  # its KV cache was computed under W0
    _drain(engine)
    engine.load_weights(0, W1)  # idle: replacing is fine
    engine.drop_version(0)
    assert engine.hosted_versions() == ()


def test_a_request_with_nothing_to_generate_is_refused_not_run_past_its_cap() -> None:
    """``max_new_tokens`` caps the response, prefix included: at 0, or already reached by the prefix, the prefill
    sampled one token past it. An empty prompt was accepted and then broke every later step."""
    engine = _engine()
    with pytest.raises(ValueError, match=r"max_new_tokens\(0\) leaves no token to generate after the prefix\(0\)"):
        engine.add_request(_request(0, max_new_tokens=0))
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request(dataclasses.replace(_request(1), prompt_ids=()))
    engine.add_request(_request(2, max_new_tokens=3))
    _step_until_generated(engine, 2)
    partial = engine.abort("r2")
    assert partial is not None and len(partial.response_ids) == 2 and engine.num_active() == 0
    with pytest.raises(ValueError, match=r"max_new_tokens\(2\) leaves no token to generate after the prefix\(2\)"):
        engine.add_request(_request(2, max_new_tokens=2, prefix=partial))
    assert engine.num_waiting() == 0
    engine.add_request(_request(2, max_new_tokens=3, prefix=partial))
    assert len(_drain(engine)["r2"].response_ids) == 3


def test_sampling_follows_the_softmax() -> None:
    """Gumbel-max with hashed noise draws tokens with frequencies close to softmax(logits / T)."""
    n = 20_000
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]]).expand(n, 4)
    tokens, logprobs = sample_tokens(logits, torch.full((n,), 1.0), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=4).double() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
    u = uniform_noise(torch.tensor([7]), torch.tensor([3]), 10_000)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.01


def _reference_sample(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling as first written (out of place, seeds hashed at every call): the fast path must match it bit for bit."""
    keys = _mix32(seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ 0x5BD1E995)
    per_position = _mix32((keys ^ (positions * 0x3C6EF372)) & _MASK32)
    h = _mix32((per_position[:, None] ^ (torch.arange(logits.shape[-1]) * 0x1B873593)[None, :]) & _MASK32)
    u = (h.to(torch.float64) + 0.5) / 2.0**32
    greedy = temps <= 0
    logp = torch.log_softmax(logits.float() / torch.where(greedy, torch.ones_like(temps), temps)[:, None], dim=-1)
    gumbel = torch.where(greedy[:, None], torch.zeros_like(u), -torch.log(-torch.log(u)))
    tokens = torch.argmax(logp.double() + gumbel, dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("trial", range(4))
def test_keyed_sampling_is_bit_identical_to_hashing_the_seeds_each_step(trial: int) -> None:
    gen = torch.Generator().manual_seed(trial)
    n, vocab = 64, 192
    seeds = [int(s) for s in torch.randint(-2**62, 2**62, (n,), generator=gen)] + [0, 2**63 - 1, -1, -2**63]
    t = torch.tensor(seeds)
    assert [noise_key(s) for s in seeds] == (_mix32(t & _MASK32) ^ _mix32(((t >> 32) & _MASK32) ^ 0x5BD1E995)).tolist()
    b = len(seeds)
    logits = torch.randn(b, vocab, generator=gen) * 3
    positions = torch.randint(0, 130, (b,), generator=gen)
    temps = torch.rand(b, generator=gen) * 2
    keys = torch.tensor([noise_key(s) for s in seeds])
    for temps_case, any_greedy in ((temps, False), (torch.where(temps < 0.5, 0.0, temps), True)):
        expected = _reference_sample(logits, temps_case, t, positions)
        for got in (sample_keyed(logits, temps_case, keys, positions, any_greedy=any_greedy),
                    sample_tokens(logits, temps_case, t, positions)):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_min_new_tokens_masks_eos_and_records_the_masked_logprobs() -> None:
    plain = [_run_alone(_request(i, max_new_tokens=12), W0) for i in range(12)]
    assert any(t.finish_reason == "stop" and len(t.response_ids) < 10 for t in plain), "needs early EOS to mask"
    for i in range(12):
        t = _run_alone(_request(i, max_new_tokens=12, min_new_tokens=10), W0)
        assert EOS not in t.response_ids[:10] and len(t.response_ids) >= 10
        model = TinyTransformer(MODEL)
        model.load_state_dict(W0)
        tokens = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
        with torch.no_grad():
            logits = model.forward_rows(tokens, torch.arange(tokens.shape[1])[None], torch.zeros_like(tokens))[0]
        p = len(t.prompt_ids)
        for j, tok in enumerate(t.response_ids):
            row = logits[p - 1 + j].clone()
            if j < 10:
                row[EOS] = float("-inf")
            assert t.behaviour_logprobs[j] == pytest.approx(float(torch.log_softmax(row, -1)[tok]), abs=1e-5)


def test_planner_models_the_engines_prompt_ingestion_limit() -> None:
    """The cost model charges short prompts as decode rows exactly up to the engine's default limit."""
    from planner.rollout_cost import CPU_DECODE_INGEST_MAX_TOKENS

    assert RolloutConfig(model=MODEL, eos_token_id=EOS).decode_ingest_max_tokens == CPU_DECODE_INGEST_MAX_TOKENS


def test_last_step_shape_reports_what_the_step_computed() -> None:
    engine = _engine(4, v0=W0, v1=W1)
    assert tuple(engine.last_step_shape()) == (0, 0, 0, 0)
    for i in range(3):
        engine.add_request(_request(i, version=i % 2, max_new_tokens=20, min_new_tokens=20))
    engine.step()  # admits all three: prompts are ingested through the decode batch or prefilled
    first = engine.last_step_shape()
    prompt_tokens = sum(len(_request(i).prompt_ids) for i in range(3))
    if INGEST["ingest"]:
        assert (first.decode_rows, first.context_tokens, first.prefill_tokens) == (3, 0, 0)
    else:
        assert (first.decode_rows, first.prefill_tokens) == (0, prompt_tokens)
    _step_until_generated(engine, 3 * 5)
    engine.step()
    shape = engine.last_step_shape()
    assert shape.decode_rows == 3 and shape.versions == 2 and shape.prefill_tokens == 0
    assert shape.context_tokens == sum(s.cached_len for s in engine._slots) - 3  # each row took one position


def test_weights_staged_while_decoding_then_installed_change_no_token() -> None:
    """A worker builds a new version's model (``stage_weights``) on another thread while the engine decodes, and
    installs it between two steps: the sequences already running, and those started on the new version, generate
    exactly what they would have alone."""
    engine = _engine()
    old = [_request(i) for i in range(4)]
    for r in old:
        engine.add_request(r)
    _step_until_generated(engine, 8)
    staged: list[object] = []
    stager = threading.Thread(target=lambda: staged.append(engine.stage_weights(1, W1)))
    stager.start()
    _step_until_generated(engine, 16)
    stager.join()
    assert engine.hosted_versions() == (0,)  # staging touches nothing the engine serves
    engine.install_weights(1, staged[0])
    new = [_request(i, version=1) for i in range(4, 8)]
    for r in new:
        engine.add_request(r)
    done = _drain(engine)
    for r in old + new:
        assert done[r.request_id].response_ids == _run_alone(r, W0 if r.version == 0 else W1).response_ids
    with pytest.raises(TypeError, match="expected stage_weights' model, got dict"):
        engine.install_weights(2, W1)
