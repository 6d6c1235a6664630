"""Trainer and GRPO maths: packing, advantages, off-policy losses by hand, versions and checkpoints."""

import math
import random

import pytest
import torch

from dora.runtime.engines.base import FinishedTrajectory, GenerationRequest, ScoredTrajectory, Trainer
from dora.runtime.engines.tiny_model import TinyModelConfig, TinyTransformer
from dora.runtime.engines.torch_rollout import RolloutConfig, TorchRolloutEngine
from dora.runtime.engines.torch_trainer import (
    TorchTrainer,
    TrainerConfig,
    pack,
    target_logprobs,
    token_logprobs,
    warm_up,
)
from dora.runtime.grpo import group_advantages, policy_loss
from dora.runtime.tasks import TaskConfig
from planner.workload import LengthDistribution

torch.set_num_threads(1)

MODEL = TinyModelConfig(vocab_size=20, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16, ffn_size=64)
SEQS = [((0, 3, 4), (5, 6, 7, 1)), ((0, 9), (2,)), ((0, 8, 8, 8), (4, 4, 4, 4, 4, 4, 1)), ((0, 2), (3, 1))]


def test_pack_wastes_no_tokens_and_matches_per_sequence_logprobs() -> None:
    model = TinyTransformer(MODEL, seed=0).eval()
    packed = pack(list(SEQS), pack_len=12)
    used = int((packed.segment_ids >= 0).sum())
    assert used == sum(len(p) + len(r) for p, r in SEQS)
    # Sequence lengths 7, 3, 11, 4; first-fit-decreasing into rows of 12: {11}, {7, 4}, {3}.
    assert packed.token_ids.shape == (3, 11 + 0)  # rows are as wide as the fullest row, not pack_len
    assert packed.segment_ids.tolist()[1] == [0] * 7 + [1] * 4
    with torch.no_grad():
        together = token_logprobs(model, packed, temperature=0.8)
        one_by_one = torch.cat([token_logprobs(model, pack([s], 12), temperature=0.8) for s in SEQS])
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=0)
    assert packed.target_ids.tolist() == [t for _, r in SEQS for t in r]


def _random_sequences(rng: random.Random, n: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(rng.randrange(20) for _ in range(rng.randint(1, 4))),
             tuple(rng.randrange(20) for _ in range(rng.choice([0, 1, 2, 5, 9, 20])))) for _ in range(n)]


def test_pack_puts_each_sequence_whole_where_its_indices_say() -> None:
    rng = random.Random(0)
    for pack_len in (4, 12, 40):
        seqs = _random_sequences(rng, 30)
        packed = pack(seqs, pack_len)
        tokens, positions = packed.token_ids.reshape(-1), packed.position_ids.reshape(-1)
        assert int((packed.segment_ids >= 0).sum()) == sum(len(p) + len(r) for p, r in seqs)
        # the logit at index i predicts the token after it: the trained token, at its position in its sequence
        assert torch.equal(tokens[packed.logit_index + 1], packed.target_ids)
        assert positions[packed.logit_index + 1].tolist() == [len(p) + j for p, r in seqs for j in range(len(r))]
        assert packed.target_ids.tolist() == [t for _, r in seqs for t in r]
        pad = packed.segment_ids < 0
        assert not bool(tokens[pad.reshape(-1)].any()) and not bool(positions[pad.reshape(-1)].any())


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_token_logprobs_equal_the_packed_rows_forward_in_values_and_gradients(temperature: float) -> None:
    """``token_logprobs`` runs the sequences flat, attended one by one; the rows forward (block-diagonal mask over
    the packed rows, padding included) computes the same log-probs and gradients, up to float rounding."""
    model = TinyTransformer(MODEL, seed=2)
    packed = pack(_random_sequences(random.Random(1), 25), 24)
    new = token_logprobs(model, packed, temperature)
    old = target_logprobs(model.forward_rows(packed.token_ids, packed.position_ids, packed.segment_ids), packed,
                          temperature)
    torch.testing.assert_close(new, old, atol=1e-5, rtol=0)
    weights = torch.linspace(-1.0, 1.0, len(old))
    grads_new = torch.autograd.grad((new * weights).sum(), list(model.parameters()))
    grads_old = torch.autograd.grad((old * weights).sum(), list(model.parameters()))
    for a, b in zip(grads_new, grads_old, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_packed_loss_equals_token_weighted_per_sequence_loss() -> None:
    model = TinyTransformer(MODEL, seed=1)
    adv = [0.5, -1.0, 2.0, 0.3]
    behaviour_shift = -0.2  # mu a bit below pi: w = e^0.2 for every token

    def loss_of(seqs: list, advs: list[float]) -> torch.Tensor:
        logp = token_logprobs(model, pack(seqs, 12))
        a = torch.tensor([x for (_, r), x in zip(seqs, advs, strict=True) for _ in r])
        total, _ = policy_loss(logp, logp.detach(), logp.detach() + behaviour_shift, a, correction="tis", is_weight_cap=5.0)
        return total

    n_tokens = sum(len(r) for _, r in SEQS)
    packed_loss = loss_of(list(SEQS), adv) / n_tokens
    per_sequence = sum(loss_of([s], [a]) for s, a in zip(SEQS, adv, strict=True)) / n_tokens
    torch.testing.assert_close(packed_loss, per_sequence, atol=1e-6, rtol=0)
    # Hand value: at pi = pi_prox the ratio is 1, so l_t = -min(e^0.2, 5) * A.
    expected = -math.exp(0.2) * sum(a * len(r) for (_, r), a in zip(SEQS, adv, strict=True)) / n_tokens
    assert float(packed_loss.detach()) == pytest.approx(expected, rel=1e-6)


def test_group_advantages_by_hand() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5, 0.2, 0.9, 0.9]
    groups = ["a", "a", "b", "b", "c", "d", "d"]
    adv = group_advantages(rewards, groups)
    # group a: mean 0.5, population std 0.5 -> +-1; b and d have equal rewards, c is alone -> 0.
    assert adv == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-5)
    adv3 = group_advantages([0.0, 0.3, 0.9], ["g"] * 3)
    mean, std = 0.4, math.sqrt(((0.4) ** 2 + 0.1**2 + 0.5**2) / 3)
    assert adv3 == pytest.approx([(r - mean) / std for r in (0.0, 0.3, 0.9)], rel=1e-5)
    # Equal rewards whose float mean is not exactly theirs (0.1 * 3 / 3): still exactly 0, not +-1e-11.
    assert group_advantages([0.1] * 3 + [1 / 7] * 8, ["e"] * 3 + ["f"] * 8) == [0.0] * 11
    with pytest.raises(ValueError, match=r"len\(rewards\)\(2\) != len\(group_ids\)\(1\)"):
        group_advantages([1.0, 2.0], ["a"])


def _loss_and_grad(correction: str, logp: list[float], prox: list[float], mu: list[float], adv: list[float],
                   cap: float | None) -> tuple[float, list[float], object]:
    x = torch.tensor(logp, requires_grad=True)
    total, stats = policy_loss(x, torch.tensor(prox), torch.tensor(mu), torch.tensor(adv),
                               correction=correction, clip_eps=0.2, is_weight_cap=cap)
    total.backward()
    return float(total.detach()), x.grad.tolist(), stats


def test_tis_by_hand() -> None:
    # Token 1: w = e^1 = 2.718 > C = 2 (truncated); token 2: w = e^-0.5 = 0.607. Ratio r = e^0.1 / e^0.
    logp, prox, mu, adv = [0.1, 0.0], [0.0, 0.0], [-1.0, 0.5], [1.0, -2.0]
    total, grad, stats = _loss_and_grad("tis", logp, prox, mu, adv, 2.0)
    w2 = math.exp(-0.5)
    assert total == pytest.approx(-2.0 * math.exp(0.1) * 1.0 - w2 * 1.0 * -2.0, rel=1e-6)
    assert grad == pytest.approx([-2.0 * math.exp(0.1), w2 * 2.0], rel=1e-6)  # d(-c r A)/dlogp = -c r A
    assert stats.is_weight_clipped == 1 and stats.ppo_clipped == 0
    assert stats.is_weight_max == pytest.approx(math.e, rel=1e-6)
    assert stats.is_weight_sum == pytest.approx(math.e + w2, rel=1e-6)


def test_decoupled_ppo_by_hand() -> None:
    # Token 1: r = e^0.5 = 1.65 > 1.2 with A > 0 -> clipped, constant, no gradient.
    # Token 2: r = e^-0.5 = 0.61 < 0.8 with A > 0 -> min picks r A (unclipped), gradient flows.
    # Behaviour weights w = pi_prox / mu = e^0.3 and e^-0.1, uncapped.
    logp, prox, mu, adv = [0.5, -0.5], [0.0, 0.0], [-0.3, 0.1], [1.0, 1.0]
    total, grad, stats = _loss_and_grad("decoupled-ppo", logp, prox, mu, adv, None)
    w1, w2 = math.exp(0.3), math.exp(-0.1)
    assert total == pytest.approx(-w1 * 1.2 - w2 * math.exp(-0.5), rel=1e-6)
    assert grad == pytest.approx([0.0, -w2 * math.exp(-0.5)], rel=1e-6)
    assert stats.ppo_clipped == 1 and stats.is_weight_clipped == 0
    # With a cap of 1.0 the first weight is truncated.
    total_capped, _, stats = _loss_and_grad("decoupled-ppo", logp, prox, mu, adv, 1.0)
    assert total_capped == pytest.approx(-1.0 * 1.2 - w2 * math.exp(-0.5), rel=1e-6)
    assert stats.is_weight_clipped == 1


def test_none_is_plain_ppo_and_ignores_behaviour() -> None:
    logp, prox, adv = [0.5, -0.5], [0.0, 0.0], [-1.0, 1.0]
    a, ga, _ = _loss_and_grad("none", logp, prox, [-3.0, 3.0], adv, 2.0)
    b, gb, stats = _loss_and_grad("none", logp, prox, [0.0, 0.0], adv, 2.0)
    # A < 0 with r = 1.65: min(-1.65, -1.2) = -1.65 unclipped; A > 0 with r = 0.61: unclipped too.
    assert a == b == pytest.approx(math.exp(0.5) - math.exp(-0.5), rel=1e-6)
    assert ga == gb and stats.ppo_clipped == 0 and stats.is_weight_clipped == 0
    with pytest.raises(ValueError, match="needs is_weight_cap"):
        _loss_and_grad("tis", logp, prox, prox, adv, None)


def _rollout(weights: dict[str, torch.Tensor], version: int, n: int) -> list[FinishedTrajectory]:
    engine = TorchRolloutEngine(RolloutConfig(model=MODEL, eos_token_id=1, max_num_seqs=n, max_model_len=24))
    engine.load_weights(version, weights)
    for i in range(n):
        engine.add_request(GenerationRequest(request_id=f"r{i}", prompt_ids=(0, 3 + i % 2), version=version,
                                             max_new_tokens=12, seed=i))
    out: list[FinishedTrajectory] = []
    while engine.num_active() or engine.num_waiting():
        out.extend(engine.step())
    return sorted(out, key=lambda t: t.request_id)


def _scored(trajs: list[FinishedTrajectory]) -> list[ScoredTrajectory]:
    # Reward: fraction of token 5 in the response (a learnable preference), two prompts = two groups.
    return [ScoredTrajectory(trajectory=t, reward=t.response_ids.count(5) / len(t.response_ids),
                             group_id=str(t.prompt_ids)) for t in trajs]


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled-ppo"])
def test_train_step_versions_staleness_and_on_policy_weights(correction: str) -> None:
    trainer = TorchTrainer(TrainerConfig(model=MODEL, off_policy_correction=correction, num_minibatches=2, seed=3))
    assert isinstance(trainer, Trainer)
    v0, w0 = trainer.export_weights()
    assert v0 == 0 and all(t.is_contiguous() and t.device.type == "cpu" for t in w0.values())
    fresh = _scored(_rollout(w0, 0, 8))
    m1 = trainer.train_step(fresh)
    # On-policy: the engine's behaviour log-probs equal the trainer's, so w = 1 to float precision.
    assert m1.version == 1 and m1.mean_staleness == 0.0 and m1.max_staleness == 0
    assert m1.is_weight_mean == pytest.approx(1.0, abs=1e-4) and m1.is_weight_max < 1.001
    assert m1.num_trained_tokens == sum(len(s.trajectory.response_ids) for s in fresh)
    assert m1.num_forward_tokens == m1.num_trained_tokens + sum(len(s.trajectory.prompt_ids) for s in fresh)
    # Replaying version-0 data to a version-1 trainer: staleness 1 and weights no longer exactly 1.
    m2 = trainer.train_step(fresh)
    assert m2.version == 2 and m2.mean_staleness == 1.0
    assert abs(m2.is_weight_mean - 1.0) > 1e-4 or m2.is_weight_max > 1.001


def test_temperature_zero_samples_greedily_and_trains_on_the_log_probs_it_recorded() -> None:
    """Temperature 0 (greedy; runtime.json accepts it): the engine records log-probs under ``softmax(logits)``, and
    the trainer scores under the same (it divided the logits by 0: NaN log-probs, silently)."""
    trainer = TorchTrainer(TrainerConfig(model=MODEL, temperature=0.0, seed=3))
    version, weights = trainer.export_weights()
    engine = TorchRolloutEngine(RolloutConfig(model=MODEL, eos_token_id=1, max_num_seqs=4, max_model_len=24))
    engine.load_weights(version, weights)
    for i in range(4):
        engine.add_request(GenerationRequest(request_id=f"r{i}", prompt_ids=(0, 3 + i % 2), version=version,
                                             max_new_tokens=12, temperature=0.0, seed=i))
    trajs: list[FinishedTrajectory] = []
    while engine.num_active() or engine.num_waiting():
        trajs.extend(engine.step())
    trajs.sort(key=lambda t: t.request_id)
    assert trajs[0].response_ids == trajs[2].response_ids  # greedy: the seed does not matter
    packed = pack([(t.prompt_ids, t.response_ids) for t in trajs], 24)
    with torch.no_grad():
        scored = token_logprobs(trainer.model, packed, temperature=0.0)
    recorded = torch.tensor([lp for t in trajs for lp in t.behaviour_logprobs])
    torch.testing.assert_close(scored, recorded, atol=1e-5, rtol=0)
    metrics = trainer.train_step(_scored(trajs))
    assert math.isfinite(metrics.loss) and metrics.is_weight_mean == pytest.approx(1.0, abs=1e-4)


def test_training_raises_the_reward_direction() -> None:
    trainer = TorchTrainer(TrainerConfig(model=MODEL, learning_rate=5e-3, seed=4))
    model = trainer.model
    probe = pack([((0, 3), (5,)), ((0, 4), (5,))], 12)
    with torch.no_grad():
        before = float(token_logprobs(model, probe).mean())
    for _ in range(8):
        v, w = trainer.export_weights()
        trainer.train_step(_scored(_rollout(w, v, 16)))
    with torch.no_grad():
        after = float(token_logprobs(model, probe).mean())
    assert after > before + 0.5, (before, after)


def test_state_dict_round_trip_continues_identically() -> None:
    config = TrainerConfig(model=MODEL, seed=5)
    a = TorchTrainer(config)
    batch = _scored(_rollout(a.export_weights()[1], 0, 6))
    a.train_step(batch)
    b = TorchTrainer(TrainerConfig(model=MODEL, seed=99))
    b.load_state_dict(a.state_dict())
    assert b.version == 1 and b.step == 1
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma.loss == mb.loss and ma.version == mb.version == 2
    for key, value in a.export_weights()[1].items():
        assert torch.equal(value, b.export_weights()[1][key])


class _CountingTrainer(TorchTrainer):
    """Counts its optimiser steps."""

    def __init__(self, config: TrainerConfig) -> None:
        super().__init__(config)
        self.optimiser_steps = 0

    def apply_gradients(self) -> float:
        self.optimiser_steps += 1
        return super().apply_gradients()


@pytest.mark.parametrize("minibatches, epochs", [(1, 1), (1, 3), (2, 2)])
def test_ppo_epochs_pass_over_the_batch_again_against_the_weights_before_the_step(
        minibatches: int, epochs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``algorithm.ppo_epochs`` (priced by the planner as more optimiser steps and passes) reached no trainer: every
    step took one pass. Each pass takes one optimiser step per minibatch, and every pass's PPO ratio is to the
    weights before the step (one proximal forward, not one per pass)."""
    trainer = _CountingTrainer(TrainerConfig(model=MODEL, num_minibatches=minibatches, ppo_epochs=epochs, seed=3,
                                             learning_rate=5e-3))
    batch = _scored(_rollout(trainer.export_weights()[1], 0, 8))
    calls: list[bool] = []
    real = token_logprobs

    def counted(model, rows, temperature=1.0):
        calls.append(torch.is_grad_enabled())
        return real(model, rows, temperature)

    monkeypatch.setattr("dora.runtime.engines.torch_trainer.token_logprobs", counted)
    metrics = trainer.train_step(batch)
    assert trainer.optimiser_steps == minibatches * epochs
    assert calls.count(True) == minibatches * epochs  # one forward with gradients per minibatch and pass
    assert calls.count(False) == (minibatches if minibatches * epochs > 1 else 0)  # the proximal forward, once
    if minibatches * epochs == 1:
        assert metrics.ppo_clip_frac == 0  # the ratio to the weights it is computed with is exactly 1
    assert metrics.kl_mean == 0.0 and math.isfinite(metrics.loss)


def test_the_kl_penalty_pulls_towards_version_0_and_is_the_k3_estimate() -> None:
    """``algorithm.kl_coef`` reached no trainer (the plan priced a reference forward; the run trained without the
    penalty). The reference is version 0's weights; the reported KL is the token mean of
    ``exp(ref - logp) - (ref - logp) - 1`` under the weights before each step."""
    base = TorchTrainer(TrainerConfig(model=MODEL, learning_rate=2e-2, seed=4))
    v0 = base.export_weights()[1]
    batches = [_scored(_rollout(v0, 0, 16))] * 6
    drift = {}
    for kl_coef in (0.0, 5.0):
        trainer = TorchTrainer(TrainerConfig(model=MODEL, learning_rate=2e-2, seed=4, kl_coef=kl_coef))
        klm = []
        for batch in batches:
            before = trainer.export_weights()[1]
            metrics = trainer.train_step(batch)
            klm.append(metrics.kl_mean)
            if kl_coef:  # the reported KL, computed independently from the weights the step started from
                rows = pack([(s.trajectory.prompt_ids, s.trajectory.response_ids) for s in batch], 256)
                with torch.no_grad():
                    now = TinyTransformer(MODEL)
                    now.load_state_dict(before)
                    ref = TinyTransformer(MODEL)
                    ref.load_state_dict(v0)
                    d = token_logprobs(ref, rows) - token_logprobs(now, rows)
                assert metrics.kl_mean == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-4, abs=1e-9)
        assert (klm[0] == 0.0) and (all(k == 0.0 for k in klm) == (kl_coef == 0))
        rows = pack([(s.trajectory.prompt_ids, s.trajectory.response_ids) for s in batches[0]], 256)
        ref = TinyTransformer(MODEL)
        ref.load_state_dict(v0)
        with torch.no_grad():
            d = token_logprobs(ref, rows) - token_logprobs(trainer.model, rows)
        drift[kl_coef] = float((d.exp() - d - 1).mean())
    assert drift[5.0] < 0.5 * drift[0.0], drift


def test_the_kl_reference_survives_a_checkpoint_and_a_restore_without_it_is_refused() -> None:
    config = TrainerConfig(model=MODEL, seed=5, kl_coef=0.5, learning_rate=1e-2)
    a = TorchTrainer(config)
    batch = _scored(_rollout(a.export_weights()[1], 0, 6))
    a.train_step(batch)
    b = TorchTrainer(TrainerConfig(model=MODEL, seed=99, kl_coef=0.5, learning_rate=1e-2))
    b.load_state_dict(a.state_dict())
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma.loss == mb.loss and ma.kl_mean == mb.kl_mean > 0
    old = a.state_dict()
    del old["reference"]
    c = TorchTrainer(config)
    c.load_state_dict(old)
    with pytest.raises(RuntimeError, match="reference policy"):
        c.train_step(batch)


def test_warm_up_is_cached_by_content(tmp_path) -> None:
    task = TaskConfig(number_tokens=17, warmup_steps=3, warmup_batch_size=4)
    lengths = LengthDistribution.lognormal(median=4, p99=12, max_tokens=16)
    a = TorchTrainer(TrainerConfig(model=MODEL, seed=0))
    losses = warm_up(a, task, lengths, seed=1, cache_dir=tmp_path)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    b = TorchTrainer(TrainerConfig(model=MODEL, seed=0))
    assert warm_up(b, task, lengths, seed=1, cache_dir=tmp_path) == []
    for key, value in a.export_weights()[1].items():
        assert torch.equal(value, b.export_weights()[1][key])
    assert a.version == b.version == 0
    c = TorchTrainer(TrainerConfig(model=MODEL, seed=0))
    assert len(warm_up(c, task, lengths, seed=2, cache_dir=tmp_path)) == 3  # another seed: not the cached file


def test_two_runs_filling_the_warm_up_cache_at_once_never_clash(tmp_path, monkeypatch) -> None:
    """Runs sharing a cache that finish warm-up together: here run B warms up and fills the cache while run A is
    between writing its copy and renaming it. A fixed temporary name once made A rename a file B had already moved
    (FileNotFoundError) or publish half a file; each now writes its own, and both end with the cached weights."""
    import dora.runtime.engines.torch_trainer as trainer_module

    task = TaskConfig(number_tokens=17, warmup_steps=1, warmup_batch_size=4)
    lengths = LengthDistribution.lognormal(median=4, p99=12, max_tokens=16)
    save, saved = torch.save, []
    b = TorchTrainer(TrainerConfig(model=MODEL, seed=0))

    def save_then_let_b_finish(obj, f, *args, **kwargs) -> None:
        save(obj, f, *args, **kwargs)
        saved.append(f)
        if len(saved) == 1:  # A's copy is written, not yet renamed
            assert len(warm_up(b, task, lengths, seed=1, cache_dir=tmp_path)) == 1

    monkeypatch.setattr(trainer_module.torch, "save", save_then_let_b_finish)
    a = TorchTrainer(TrainerConfig(model=MODEL, seed=0))
    assert len(warm_up(a, task, lengths, seed=1, cache_dir=tmp_path)) == 1
    assert len(saved) == 2
    monkeypatch.undo()
    (cached,) = tmp_path.iterdir()  # one file, no temporary left behind
    assert cached.name.startswith("warmup-") and cached.suffix == ".pt"
    c = TorchTrainer(TrainerConfig(model=MODEL, seed=0))
    assert warm_up(c, task, lengths, seed=1, cache_dir=tmp_path) == []
    for key, value in a.export_weights()[1].items():
        assert torch.equal(value, b.export_weights()[1][key]) and torch.equal(value, c.export_weights()[1][key])


def test_supervised_step_label_smoothing_by_hand() -> None:
    trainer = TorchTrainer(TrainerConfig(model=MODEL, seed=6))
    examples = [((0, 3), (4, 5, 1)), ((0, 7, 8), (9, 1))]
    with torch.no_grad():
        rows = pack(examples, 12)
        logits = trainer.model.forward_rows(rows.token_ids, rows.position_ids, rows.segment_ids)
        logp = torch.log_softmax(logits.reshape(-1, MODEL.vocab_size)[rows.logit_index], dim=-1)
        e = 0.3
        expected = -((1 - e) * logp.gather(1, rows.target_ids[:, None]).squeeze(1) + e * logp.mean(-1)).mean()
    optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.0)
    assert trainer.supervised_step(examples, optimizer, label_smoothing=e) == pytest.approx(float(expected), rel=1e-6)
    assert trainer.version == 0


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_a_step_in_parts_takes_the_whole_batch_step(kl_coef: float) -> None:
    """An early step (``PolicyConfig.early_steps``) trains its batch as it arrives, whole groups per part: the same
    step as on the whole batch, to float precision, in weights and metrics, whatever the parts."""
    base = TorchTrainer(TrainerConfig(model=MODEL, learning_rate=2e-2, kl_coef=kl_coef, seed=4))
    v0 = base.export_weights()[1]
    batch = _scored(_rollout(v0, 0, 12))  # two groups (two prompts), interleaved
    groups = sorted({s.group_id for s in batch})
    whole = TorchTrainer(TrainerConfig(model=MODEL, learning_rate=2e-2, kl_coef=kl_coef, seed=4))
    parted = TorchTrainer(TrainerConfig(model=MODEL, learning_rate=2e-2, kl_coef=kl_coef, seed=4))
    for _ in range(2):  # the second step starts from an optimizer with moments
        expected = whole.train_step(batch)
        parted.train_part([s for s in batch if s.group_id == groups[0]])
        got = parted.train_step([s for s in batch if s.group_id == groups[1]])
        assert got.version == expected.version and parted.version == whole.version
        for name in ("loss", "kl_mean", "grad_norm", "is_weight_mean", "reward_mean"):
            assert getattr(got, name) == pytest.approx(getattr(expected, name), rel=1e-5, abs=1e-7), name
        assert (got.num_sequences, got.num_trained_tokens) == (expected.num_sequences, expected.num_trained_tokens)
        w_whole, w_parted = whole.export_weights()[1], parted.export_weights()[1]
        # Adam divides each gradient by its own scale: float rounding of a near-zero gradient moves a weight ~1e-6
        assert all(torch.allclose(w_whole[k], w_parted[k], rtol=1e-4, atol=1e-5) for k in w_whole)
        assert any(not torch.equal(v0[k], w_parted[k]) for k in v0)
    with pytest.raises(ValueError, match="one optimizer step"):
        TorchTrainer(TrainerConfig(model=MODEL, num_minibatches=2, seed=4)).train_part(batch)
