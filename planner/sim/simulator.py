"""Discrete-event simulator: drives a scheduling policy with engine, trainer and weight-sync timings.

Events live in one heap ordered by ``(time_s, sequence)``, so ties resolve in creation order and a
run is a pure function of its inputs and seed.

Engine replica model (continuous batching, no per-token events). Every running sequence of replica
``r`` advances one token per decode step, so the replica keeps a step counter ``pos`` and each
sequence finishes at ``pos = start_pos + length``. Between two batch changes the step time is taken
as constant, evaluated at the interval's mean context:

    B = running sequences,  C(pos) = B * prompt + B * pos - sum(start_pos)
    dt = (next_finish_pos - pos) * decode_step_s(B, C(pos) + B * (next_finish_pos - pos) / 2)

A replica is a heap of ``(finish_pos, trajectory)`` and costs O(log B) per finished trajectory.
At most ``slots_per_group`` sequences run; requests admitted beyond them (the policy's
``admission_queue``) wait in a FIFO and start, from the replica's current ``pos``, when a slot frees.
Admitting a prompt group pauses decoding for one prefill of the shared prompt (the group's
samples share it, as with prefix caching), unless the engine feeds prompts of at most
``prompt_ingest_max_tokens`` through the decode batch (dora's CPU engine, outside modes that interrupt
in-flight requests): then each new sequence runs ``prompt - 1`` decode steps, as a row of the batch,
before its first sampled token (its start position is that many steps ahead). Loading weights pauses the
replica; with ``resume_in_flight`` the in-flight contexts are re-prefilled on the new weights afterwards.
With ``max_versions_per_engine > 1`` a replica decodes all its sequences in one batched step whatever
their versions, plus ``extra_version_step_s`` per hosted version with running sequences beyond the
first (reading that version's weights, and the engine's per-version overhead);
a ``LoadWeights(keep_loaded=True)`` is staged beside the running batch (the replica keeps decoding) and the
version is served once the load's time has passed.
On one host (``cpu`` rollout and trainer on disjoint cores) the two slow each other down: while a training
step runs, decode steps take ``rollout_contention`` times longer (every replica's step time is re-evaluated
when a step starts and ends), and a training step runs ``train_contention`` times slower while some replica
decodes (its end is re-evaluated whenever that starts or stops being so: a step that starts while the engines
wait for their weights and runs beside their next rollout is slowed for that part); while two or more replicas
decode at once, their steps take ``engine_contention`` times longer (re-evaluated in the same way). All three are
1 on separate devices.
Colocated streaming: ``SuspendRollout`` stops every replica once its load or KV send in progress ends, and moves its
weights and its sequences' KV cache to host memory, ``swap_fixed_s + swap_s_per_version * versions hosted +
swap_s_per_token * context``; the trainer gets the accelerators when the slowest replica is done. ``ResumeRollout``
moves them back the same way; each replica decodes again as soon as its own copy is back (``RolloutResumed`` is
reported when the slowest one is).
KV cache (``kv_capacity_tokens`` per replica, vLLM's paged cache; unlimited by default): a replica's running
sequences hold ``C(pos)`` context tokens, and C grows by B every step. A waiting sequence starts only if its context
fits beside them (below a 1% watermark, as vLLM admits). When C would outgrow the cache, the replica preempts the
sequence it scheduled last (vLLM's recompute preemption): it goes back to the front of the queue with its tokens
and, when it starts again, the replica first re-prefills its prompt and tokens (``prefill_s``). The next event of a
replica is its next finish or that crossing, whichever comes first. A migrated request the destination cannot hold
in its cache waits there the same way (its KV is recomputed when it starts).
Attention data parallelism (``attention_dp`` = dp > 1, vLLM's ``data_parallel_size``): a replica is dp ranks, each an
engine core with its own scheduler, ``ceil(slots_per_group / dp)`` sequences (the ``max_num_seqs`` dora gives each) and
``kv_capacity_tokens / dp`` of KV cache. Each request joins a rank when it reaches the replica, as vLLM's DP load
balancer (``DPLBAsyncMPClient.get_core_engine_for_request``) picks it: the lowest ``4 * waiting + running``, the first
rank on a tie; it stays there (a preempted one waits at the front of its rank's queue). A rank starts its waiting
sequences in order while it has a slot and KV room, and when its own running context would outgrow its share of the
cache it preempts its own sequence scheduled last, whatever room the other ranks have. The ranks decode in lockstep,
so a step takes what the busiest rank's does: ``decode_step_ranks_s(B, busiest rank's batch, largest rank context)``
(the KV reads and attention of the rank holding the most context; ``decode_step_s`` takes an even spread instead).
Controller round trip (``report_round_trip_s`` > 0, the ``cpu`` runtime): the policy does not hear of a finish at
once. A replica's finishes wait for its poll to return them, which it does, as the runtime's worker does
(``planner.policies.poll_batching``), once ``min_batch`` have finished, or ``linger_s`` after the first, or when the
replica has no request left; they reach the policy ``report_round_trip_s`` later, and the admissions they make reach
the replica then too. Meanwhile the freed slots idle (but for the admission queue), and the next poll of the replica
waits at it from that moment (one poll per replica in flight). A migration's source reports what finished first
(the runtime's export reply carries it).
Migration moves sequences with their generated tokens; the source replica is busy for
``kv_migration_s_per_token * moved context`` before it can load new weights (the destination is
not slowed: an optimistic simplification).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from librt.vecs import append, vec
from mypy_extensions import i64

from planner.policies import (
    Admit,
    DropVersion,
    LoadWeights,
    MigrateRequests,
    PolicyConfig,
    PublishWeights,
    ResumeRollout,
    StartTrainStep,
    SuspendRollout,
    make_policy,
    poll_batching,
)
from planner.sim.metrics import RunMetrics
from planner.sim.result import SimResult
from planner.sim.seqheap import SeqHeap, make_seq_heap
from planner.sim.timing import StepTiming
from planner.workload import LengthDistribution, Workload

_EV_LOADED = 1  # a = engine, b = version
_EV_TRAINED = 2  # a = step, b = the training's end token (``train_token``: a re-evaluated end supersedes it)
_EV_PUBLISHED = 3  # a = version
_EV_SUSPENDED = 4  # every replica stopped (colocated streaming)
_EV_RESUMED = 5  # every replica serves again
_EV_LINGER = 6  # a = engine, b = timer: the poll stops lingering and returns what finished
_EV_REPORT = 7  # a = engine, b = report: a poll's finishes reach the policy
_EPS = 1e-9
_LENGTH_BLOCK = 4096
"""Most response lengths drawn ahead at once (see ``Simulator.t_len``)."""
_KV_WATERMARK = 0.01
"""Share of the KV cache kept free when a waiting sequence starts (vLLM's ``watermark``)."""


def _one_rank(batch_size: int, busiest_batch: int, busiest_context_tokens: float) -> float:
    raise AssertionError("decode_step_ranks_s on a replica of one rank")


def _int_zeros(n: int) -> vec[i64]:
    out = vec[i64]()
    for _ in range(n):
        out = append(out, 0)
    return out


def _float_zeros(n: int) -> vec[float]:
    out = vec[float]()
    for _ in range(n):
        out = append(out, 0.0)
    return out


class LengthStream:
    """The response lengths ``random.Random(seed)`` draws from one distribution, in draw order: ``drawn[i]`` is
    trajectory ``i``'s, or with ``per_group`` samples per prompt sharing one draw, group ``g``'s samples all get the
    ``g``-th draw. A run's lengths depend on nothing else, so simulations of the same workload and seed share one
    (``length_stream``): a plan search simulates a dozen candidates on the same draws and used to draw them for each.
    """

    def __init__(self, dist: LengthDistribution, seed: int, per_group: int) -> None:
        self.dist = dist
        self.rng = random.Random(seed)
        """Draws these lengths, and nothing else."""
        self.per_group = per_group
        self.drawn: list[int] = []

    def draw(self, upto: int) -> None:
        """Draw the lengths of trajectories up to ``upto`` at least, and more ahead: as many as drawn so far, at most
        ``_LENGTH_BLOCK`` (one call per block, instead of one per admitted group, keeps the sampling loop hot).
        With ``per_group`` one draw serves a group's samples (``upto`` and the count drawn are whole groups: groups
        are admitted whole)."""
        have = len(self.drawn)
        n = max(upto - have, min(have, _LENGTH_BLOCK))
        if not self.per_group:
            self.drawn.extend(self.dist.sample_many(self.rng, n))
            return
        spp = self.per_group
        for length in self.dist.sample_many(self.rng, -(-n // spp)):
            self.drawn.extend([length] * spp)


_STREAMS: dict[tuple[LengthDistribution, int, int], LengthStream] = {}
_STREAMS_KEPT = 4
"""The most recently used streams kept (a full-scale run of the 10,240-GPU spec draws ~700K lengths)."""


def length_stream(dist: LengthDistribution, seed: int, per_group: int) -> LengthStream:
    """The shared ``LengthStream`` of ``(dist, seed, per_group)``, created on first use. Sharing changes no result:
    a simulation only reads the lengths of the trajectories it admits, whoever drew them."""
    key = (dist, seed, per_group)
    stream = _STREAMS.pop(key, None)
    if stream is None:
        stream = LengthStream(dist, seed, per_group)
        while len(_STREAMS) >= _STREAMS_KEPT:
            del _STREAMS[next(iter(_STREAMS))]
    _STREAMS[key] = stream  # the most recently used last
    return stream


def _mixes(spans: list[tuple[int, int]], length: int) -> bool:
    """Do the spans ``(version, first token)`` of a trajectory of ``length`` tokens generate tokens on more than one
    version? (An update that interrupts a request before its first token gives it an empty span.)"""
    versions: set[int] = set()
    for i, (v, first) in enumerate(spans):
        end = spans[i + 1][1] if i + 1 < len(spans) else length
        if end > first:
            versions.add(v)
    return len(versions) > 1


class Simulator:
    """One run. Use ``planner.sim.simulate``; this class exists to keep the hot state in attributes."""

    def __init__(
        self,
        *,
        config: PolicyConfig,
        workload: Workload,
        timing: StepTiming,
        seed: int,
        record_events: bool,
        accelerators_per_group: int,
        train_accelerators: int,
        kv_capacity_tokens: float = math.inf,
        attention_dp: int = 1,
    ) -> None:
        if attention_dp < 1:
            raise ValueError(f"attention_dp must be >= 1, got {attention_dp}")
        self.cfg = config
        self.policy = make_policy(config)
        self.timing = timing
        self.decode_step_s = timing.decode_step_s
        """Bound once: the hot path calls it ~10^6 times (and ``timing`` may resolve attributes dynamically)."""
        self.rollout_contention = timing.rollout_contention
        self.train_contention = timing.train_contention
        self.engine_contention = timing.engine_contention
        self.training = False
        """A training step is running (decode steps take ``rollout_contention`` times longer meanwhile)."""
        self.train_left = 0.0
        """The running training step's work left at ``train_t``, in seconds uncontended."""
        self.train_t = 0.0
        self.train_contended = False
        """The running training step is slowed by ``train_contention`` (some replica decodes)."""
        self.train_token = 0
        """The pending ``_EV_TRAINED`` event's token; an earlier one is superseded."""
        self.train_step = 0
        """The running training step."""
        self.train_trace: dict[str, Any] = {}
        """The running step's ``train_step`` record (``record_events``): its end moves with the contention."""
        self.train_waiting: set[int] = set()
        """Early steps (``PolicyConfig.early_steps``): the running step's groups still generating (``_joined``)."""
        self.join_work: dict[int, tuple[float, float]] = {}
        """Early steps: group -> (its share of the step's work, that group trained alone as a step): ``_train``."""
        self.train_idle_t = -1.0
        """Early steps: since when the trainer, its work done, waits for a group of ``train_waiting`` (-1: it does not)."""
        self.publishing = False
        """A publish occupies the trainer (``weight_publish_s``)."""
        self.train_queued: StartTrainStep | None = None
        """A step the policy started during a publish: it runs when the publish ends, queued behind it on the
        trainer, as the runtime's trainer actor runs it (``PolicyBase`` module doc)."""
        self.watch_decoding = self.engine_contention != 1.0 or self.train_contention != 1.0
        """Replicas starting and stopping to decode change a contention (``_check_concurrency``)."""
        self.concurrent = False
        """Two or more replicas decode (decode steps take ``engine_contention`` times longer meanwhile)."""
        self.slowdown = 1.0
        """Factor on every decode step now: the contentions in effect (``_set_slowdown``)."""
        self.prompt = workload.prompt_tokens
        ingest = not config.interrupts and self.prompt <= timing.prompt_ingest_max_tokens
        self.ingest_steps = self.prompt - 1 if ingest else 0
        """Decode steps a new sequence spends feeding its prompt before it samples (a request resumed mid-ingest
        has no token yet; the runtime turns ingestion off in modes that interrupt in-flight requests)."""
        self.prompt_prefill_s = 0.0 if ingest else timing.prefill_s(self.prompt)
        """One prefill of the shared prompt, paid by every admitted group."""
        self.spp = config.samples_per_prompt
        self.lengths = length_stream(workload.response_length, seed,
                                     self.spp if workload.length_per_prompt else 0)
        self.seed = seed
        self.record = record_events
        self.trace: list[dict[str, Any]] = []
        if record_events:
            self.trace.append(
                {"t": 0.0, "type": "run_config", "mode": config.mode, "k": config.max_version_lag,
                 "allow_version_mixing": config.allow_version_mixing,
                 "num_rollout_groups": config.num_rollout_groups, "slots_per_group": config.slots_per_group}
            )
        n = config.num_rollout_groups
        self.e_heap: list[SeqHeap] = [make_seq_heap() for _ in range(n)]
        """Running sequences of each replica, at most ``slots_per_group``."""
        self.e_wait: list[deque[tuple[int, float]]] = [deque() for _ in range(n)]
        """Admitted, not yet running: ``(trajectory, tokens generated so far)`` in FIFO order."""
        self.cap = config.slots_per_group
        self.e_pos = [0.0] * n
        self.e_t = [0.0] * n
        """Time at which ``e_pos`` holds; in the future while the replica is busy prefilling/sending."""
        self.e_step_s = [0.0] * n
        self.e_sum_start = [0.0] * n
        self.e_event = [0] * n
        """The sequence number of replica ``r``'s pending finish event; 0 for none (an event whose number differs was
        superseded, and is skipped when it comes up)."""
        self.e_paused = [False] * n
        self.suspended = False
        """Colocated streaming: every replica is stopped (from ``SuspendRollout`` until ``ResumeRollout``)."""
        self.e_stage_end = [0.0] * n
        """When a weight load staged beside a running batch (``keep_loaded``) ends: a suspension waits for it."""
        self.swap_s_total = 0.0
        self.suspend_wall_s_total = 0.0
        """Wall seconds from each ``SuspendRollout`` until every replica has moved out, and from each ``ResumeRollout``
        until every one is back: the slowest replica each time, on the colocated step's critical path."""
        self.e_version = [0] * n
        self.multi = config.max_versions_per_engine > 1
        self.e_vcount: list[dict[int, int]] = [{} for _ in range(n)]
        """Multi-version engines only: replica -> {version: running sequences} (queued ones are not in the batch, so
        their version costs no step time until they start)."""
        self.t_len = self.lengths.drawn
        """Response length of each trajectory (index ``group * samples_per_prompt + sample``), drawn ahead of the
        admissions (``LengthStream``); groups are admitted in order, so trajectory ``i`` gets the ``i``-th length drawn
        (group ``g`` the ``g``-th with ``length_per_prompt``)."""
        self.t_spans: dict[int, list[tuple[int, int]]] = {}
        """Trajectory -> [(version, first token index)], only for trajectories that changed version."""
        self.group_left: list[int] = []
        self.heap = make_seq_heap()
        """Pending events as ``(time_s, sequence * (n + 1) + target)``: the order of ``(time_s, sequence)``, sequence
        numbers being unique. The target is the replica of an engine event (it reaches its next finish position) and
        ``n`` for any other event, whose ``(kind, a, b)`` is in ``other_events``."""
        self.n1 = n + 1
        self.other_events: dict[int, tuple[int, int, int]] = {}
        """Sequence number -> ``(kind, a, b)`` of each pending event that is not an engine event."""
        self.next_seq = itertools.count(1).__next__
        self.now = 0.0
        self.dirty: set[int] = set()
        self.m = RunMetrics(
            num_engines=n,
            slots=config.slots_per_group,
            accelerators_per_group=accelerators_per_group,
            train_accelerators=train_accelerators,
            colocated=config.colocated,
        )
        self.migrated = 0
        self.kv_cap = float(kv_capacity_tokens)
        """KV-cache tokens one replica holds (module doc); ``inf``: no limit but the slots."""
        self.kv_limited = self.kv_cap < math.inf
        self.kv_admit = self.kv_cap * (1.0 - _KV_WATERMARK)
        """A waiting sequence starts only if the running context plus its own stays below this."""
        self.dp = attention_dp
        self.ranked = attention_dp > 1
        """Replicas of several attention data-parallel ranks: sequences, slots and KV cache are tracked per rank
        (module doc); with one rank none of the per-rank state below is used."""
        self.rank_cap = -(-config.slots_per_group // attention_dp)
        """Sequences one rank runs at most (its ``max_num_seqs``)."""
        self.rank_kv_cap = self.kv_cap / attention_dp
        self.rank_kv_admit = self.rank_kv_cap * (1.0 - _KV_WATERMARK)
        # Per rank, at ``r * dp + k`` for rank k of replica r (unboxed vectors: ``_ranks_step`` reads them all on every
        # event of a replica, see ``planner.sim.seqheap``); sized 0 with one rank.
        ranks = n * attention_dp if self.ranked else 0
        self.rn = _int_zeros(ranks)
        """Running sequences of each rank."""
        self.rss = _float_zeros(ranks)
        """The sum of their start positions (``e_sum_start`` per rank): rank k holds ``rn * (prompt + pos) - rss``."""
        self.rw = _int_zeros(ranks)
        """Waiting sequences of each rank (in its replica's queue, ``e_wait``)."""
        self.t_rank = vec[i64]()
        """Trajectory -> the rank of its replica it was last given (while it runs or waits there: when it joins a
        replica's queue, ``_enqueue``)."""
        self.ranks_dpos = 0.0
        """``_ranks_step``'s steps until the replica's next event."""
        self.e_capped = [False] * n
        """Replica ``r``'s ranks last stopped starting their waiting sequences at the replica's slots."""
        self.e_cross_rank = [0] * n
        """The rank whose context reaches its cache at replica ``r``'s pending event (``e_cross``)."""
        self.decode_step_ranks_s: Callable[[int, int, float], float] = (
            timing.decode_step_ranks_s if self.ranked else _one_rank)
        """Bound once, as ``decode_step_s`` (only replicas of several ranks call it)."""
        self.e_cross = [False] * n
        """Replica ``r``'s pending event is its running context reaching ``kv_cap`` (a preemption), not a finish."""
        self.sched_stamp: dict[int, int] = {}
        """KV-limited runs: trajectory -> when its replica last scheduled it (the latest is preempted first)."""
        self.next_stamp = itertools.count().__next__
        self.recompute: set[int] = set()
        """Waiting trajectories whose KV cache is gone (preempted, or migrated where it did not fit): re-prefilled
        when they start."""
        self.preemptions = 0
        self.recomputed_sequences = 0
        """Sequences that started again without their KV cache (preempted, or migrated where it did not fit)."""
        self.recomputed_tokens = 0.0
        """Tokens re-prefilled because their KV cache was gone when they started again."""
        self.report_s = float(timing.report_round_trip_s)
        """The controller's round trip (module doc); 0: the policy hears of every finish at once."""
        self.delayed = self.report_s > 0.0
        self.linger_s, self.report_batch = poll_batching(config)
        self.unreported: list[list[int]] = [[] for _ in range(n)]
        """Round trip only: trajectories finished on each replica that its poll has not returned yet."""
        self.report_out = [0] * n
        """Round trip only: the report of each replica on its way to the policy (0: none; its poll waits at it)."""
        self.linger_timer = [0] * n
        """Round trip only: the pending linger timer of each replica's poll (0: none)."""
        self.reports: dict[int, list[int]] = {}
        """Report -> the trajectories it carries."""

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        """Schedule an event other than an engine event."""
        seq = self.next_seq()
        self.other_events[seq] = (kind, a, b)
        self.heap.push(t, seq * self.n1 + self.n1 - 1)

    def _advance(self, r: int, t: float) -> None:
        """Bring replica ``r``'s progress (``e_pos``) and its busy/slot accounting up to time ``t``.

        ``_loop`` inlines this for engine events: keep the two in step."""
        dt = t - self.e_t[r]
        if dt <= 0.0:
            return
        b = len(self.e_heap[r])
        if b and not self.e_paused[r] and not self.suspended:
            self.e_pos[r] += dt / self.e_step_s[r]
            self.m.e_busy[r] += dt
            self.m.e_slot_time[r] += b * dt
        self.e_t[r] = t

    def _reschedule(self, r: int) -> None:
        """Schedule replica ``r``'s next finish (superseding any pending one). ``_loop`` inlines this: keep in step."""
        self.e_event[r] = 0
        h = self.e_heap[r]
        if self.e_paused[r] or not len(h) or self.suspended:
            return
        b = len(h)
        pos = self.e_pos[r]
        dpos = h.top_key() - pos
        if dpos < 0.0:
            dpos = 0.0
        if self.ranked:
            step = self._ranks_step(r, pos, dpos)
            dpos = self.ranks_dpos
        else:
            ctx = b * (self.prompt + pos) - self.e_sum_start[r]
            cross = False
            if self.kv_limited and b > 1:
                room = (self.kv_cap - ctx) / b  # steps until the running context fills the KV cache
                if room < dpos:
                    dpos = room if room > 0.0 else 0.0
                    cross = True
            self.e_cross[r] = cross
            step = self.decode_step_s(b, ctx + b * dpos * 0.5)
        if self.multi:
            busy = sum(1 for bv in self.e_vcount[r].values() if bv)
            if busy > 1:
                step += (busy - 1) * self.timing.extra_version_step_s
        step *= self.slowdown
        self.e_step_s[r] = step
        seq = self.e_event[r] = self.next_seq()
        self.heap.push(self.e_t[r] + dpos * step, seq * self.n1 + r)

    def _ranks_step(self, r: int, pos: float, dpos: float) -> float:
        """Replica ``r`` of several ranks decodes from ``pos``: its step time until its next event, which comes
        ``ranks_dpos`` steps from now, at most ``dpos`` (the next finish): the first rank's context reaching that rank's
        cache, if one does before (``e_cross``, ``e_cross_rank``). The step is the busiest rank's (module doc), at the
        interval's mean context."""
        rn, rss = self.rn, self.rss
        dp: i64 = self.dp
        first: i64 = r * dp
        end = first + dp
        base = self.prompt + pos
        half = dpos * 0.5
        kv_limited, cap = self.kv_limited, self.rank_kv_cap
        cross: i64 = -1
        busiest: i64 = 0
        total: i64 = 0
        most = 0.0
        for k in range(first, end):
            n = rn[k]
            if n == 0:
                continue
            total += n
            if n > busiest:
                busiest = n
            fn = float(n)
            c = fn * base - rss[k]  # rank k's context now
            if kv_limited and n > 1:
                room = (cap - c) / fn  # steps until rank k's context fills its cache
                if room < dpos:
                    dpos = room if room > 0.0 else 0.0
                    cross = k - first
            c += fn * half
            if c > most:
                most = c
        if cross >= 0:  # the interval ends sooner: its mean context is lower
            half = dpos * 0.5
            most = 0.0
            for k in range(first, end):
                c = float(rn[k]) * (base + half) - rss[k]
                if c > most:
                    most = c
        self.e_cross[r] = cross >= 0
        self.e_cross_rank[r] = cross
        self.ranks_dpos = dpos
        return self.decode_step_ranks_s(total, busiest, most)

    # ------------------------------------------------------------------ run loop
    def run(self) -> SimResult:
        policy = self.policy
        self.m.live_versions_changed(0.0, policy.live_versions())
        self._execute(policy.start())
        self._flush()
        events = self._loop() if not policy.done else 0
        self.m.num_events = events
        if not policy.done:
            raise RuntimeError(
                f"simulation stalled at t={self.now:.3f}s after {policy.steps_done} of "
                f"{self.cfg.total_steps} steps (no pending events): policy {self.cfg.mode} deadlocked"
            )
        return self._finish()

    def _loop(self) -> int:
        """Handle events until the policy is done (or none is left); returns how many were handled.

        Engine events (a replica reaching its next finish position: nearly all of them) are handled here inline,
        with the state bound to locals: finish the replica's sequences at that position (reporting each one to the
        policy), start queued ones, reschedule the replica. The blocks marked ``_advance``, ``_flush`` and
        ``_reschedule`` are those methods' code. The event stays at the root of the heap while it is handled:
        whatever is pushed meanwhile comes later (never before now, and with a larger sequence), so the reschedule
        replaces it with one ``replace`` instead of a pop and a push. Other events, and engine events whose
        actions dirty other replicas too, take the general path (``_flush``).
        """
        policy, heap, dirty = self.policy, self.heap, self.dirty
        e_heap, e_wait, e_pos, e_t, e_step_s = self.e_heap, self.e_wait, self.e_pos, self.e_t, self.e_step_s
        e_sum_start, e_event, e_paused = self.e_sum_start, self.e_event, self.e_paused
        n1, other = self.n1, self.n1 - 1
        e_busy, e_slot_time = self.m.e_busy, self.m.e_slot_time
        t_len, group_left = self.t_len, self.group_left
        spp, prompt, multi, record = self.spp, self.prompt, self.multi, self.record
        execute = self._execute
        decode_step_s, next_seq, eps = self.decode_step_s, self.next_seq, _EPS
        watch_decoding = self.watch_decoding
        kv_limited, kv_cap, e_cross = self.kv_limited, self.kv_cap, self.e_cross
        delayed, unreported, train_waiting = self.delayed, self.unreported, self.train_waiting
        ranked, rn, rss, rw, dp = self.ranked, self.rn, self.rss, self.rw, self.dp
        events = 0
        while True:  # not `while heap`: CPython 3.11 only specializes a loop's bytecode after a few JUMP_BACKWARDs
            if not len(heap):
                break
            t = heap.top_key()
            key = heap.top_item()
            r = key % n1
            seq = key // n1
            if r == other:
                heap.pop()
                events += 1
                self.now = t
                kind, a, b = self.other_events.pop(seq)
                if kind == _EV_LOADED:
                    self._loaded(a, b)
                elif kind == _EV_TRAINED:
                    if b == self.train_token:
                        self._trained(a)
                elif kind == _EV_PUBLISHED:
                    self._published(a)
                elif kind == _EV_REPORT:
                    self._delivered(a, b)
                elif kind == _EV_LINGER:
                    if self.linger_timer[a] == b:
                        self._report(a)
                elif kind == _EV_SUSPENDED:
                    if self.record:
                        self.trace.append({"t": t, "type": "rollout_suspended"})
                    self._execute(policy.on_rollout_suspended())
                else:
                    if self.record:
                        self.trace.append({"t": t, "type": "rollout_resumed"})
                    self._execute(policy.on_rollout_resumed())
                self._flush()
                if policy.done:  # only a finished training step changes it
                    break
                continue
            if seq != e_event[r]:  # superseded by a later reschedule of the replica
                heap.pop()
                continue
            events += 1
            self.now = t
            if e_cross[r]:  # the running context reached the KV cache's size: preempt
                heap.pop()
                self._preempt(r)
                self._flush()
                continue
            h = e_heap[r]
            # _advance(r, t), except e_pos[r], which is set exactly right after
            dt = t - e_t[r]
            if dt > 0.0:
                if len(h) and not e_paused[r]:
                    e_busy[r] += dt
                    e_slot_time[r] += len(h) * dt
                e_t[r] = t
            # finish every sequence at this position (at least the first)
            e_pos[r] = pos = h.top_key()  # exact: the event was scheduled for this position
            limit = pos + eps
            halted = False  # an action suspended rollout (colocated streaming): the replica decodes no more
            wake = False  # several ranks: a finish freed a slot on a rank with sequences waiting
            while True:
                finish = h.top_key()
                idx = h.pop()
                length = t_len[idx]
                e_sum_start[r] -= finish - length
                if ranked:
                    k = r * dp + self.t_rank[idx]
                    rn[k] -= 1
                    rss[k] -= finish - length
                    if rw[k]:
                        wake = True
                gid = idx // spp
                if multi:
                    self.e_vcount[r][policy.group_version[gid]] -= 1
                group_left[gid] -= 1
                if train_waiting and not group_left[gid] and gid in train_waiting:
                    self._joined(gid)
                if record:
                    self._record_finish(idx, r, length)
                if delayed:  # the replica's poll returns it later (module doc)
                    unreported[r].append(idx)
                else:
                    actions = policy.on_trajectory_finished(gid, r)  # a method call: a direct C call when compiled
                    if actions:
                        execute(actions)
                        halted = self.suspended
                if not len(h) or h.top_key() > limit:
                    break
            if e_wait[r] and (not ranked or wake or self.e_capped[r]):
                # a rank without a finish has no more room than when it last tried (its context only grew)
                self._start_waiting(r)
            if delayed:
                self._poll(r)
            if watch_decoding:
                self._check_concurrency()
            # _flush(): the fast path when no other replica is dirty
            if dirty:
                if len(dirty) > 1 or r not in dirty:
                    dirty.add(r)
                    heap.pop()
                    self._flush()
                    continue
                dirty.clear()
            # _reschedule(r)
            if e_paused[r] or not len(h) or halted:
                e_event[r] = 0
                heap.pop()
                continue
            nb = len(h)
            pos = e_pos[r]
            dpos = h.top_key() - pos
            if dpos < 0.0:
                dpos = 0.0
            if ranked:
                step = self._ranks_step(r, pos, dpos)
                dpos = self.ranks_dpos
            else:
                ctx = nb * (prompt + pos) - e_sum_start[r]
                if kv_limited:
                    cross = False
                    if nb > 1:
                        room = (kv_cap - ctx) / nb
                        if room < dpos:
                            dpos = room if room > 0.0 else 0.0
                            cross = True
                    e_cross[r] = cross
                step = decode_step_s(nb, ctx + nb * dpos * 0.5)
            if multi:
                busy = sum(1 for bv in self.e_vcount[r].values() if bv)
                if busy > 1:
                    step += (busy - 1) * self.timing.extra_version_step_s
            step *= self.slowdown
            e_step_s[r] = step
            seq = e_event[r] = next_seq()
            heap.replace(e_t[r] + dpos * step, seq * n1 + r)
        return events

    def _flush(self) -> None:
        if self.watch_decoding:
            self._check_concurrency()
        if self.dirty:
            for r in sorted(self.dirty):
                self._reschedule(r)
            self.dirty.clear()

    def _poll(self, r: int) -> None:
        """Replica ``r``'s poll, waiting at it, returns what finished if it has ``report_batch`` of them or the replica
        has no request left; else it lingers (from the first finish) for more (module doc)."""
        waiting = self.unreported[r]
        if self.report_out[r] or not waiting:
            return
        if len(waiting) >= self.report_batch or not (len(self.e_heap[r]) or self.e_wait[r]):
            self._report(r)
        elif not self.linger_timer[r]:
            timer = self.linger_timer[r] = self.next_seq()
            self._push(self.now + self.linger_s, _EV_LINGER, r, timer)

    def _report(self, r: int) -> None:
        """Replica ``r``'s poll returns its finishes: they reach the policy one round trip from now."""
        report = self.next_seq()
        self.reports[report] = self.unreported[r]
        self.unreported[r] = []
        self.linger_timer[r] = 0
        self.report_out[r] = report
        self._push(self.now + self.report_s, _EV_REPORT, r, report)

    def _delivered(self, r: int, report: int) -> None:
        """A report reaches the policy (its admissions reach the replicas now too), and the replica's next poll waits
        at it from now. A report delivered early (``_flush_reports``) is gone: its event does nothing."""
        batch = self.reports.pop(report, None)
        if batch is None:
            return
        self.report_out[r] = 0
        self._tell(r, batch)
        self._poll(r)

    def _tell(self, r: int, batch: list[int]) -> None:
        """The policy hears of ``batch``'s finishes on replica ``r``; then their actions run, in order. Not one by one:
        the runtime's controller takes a message's finishes in turn, and a migration one of them starts completes in a
        later message (the export's reply), so the policy has heard of every finish of this one by then; a migration
        here completes at once."""
        policy, spp = self.policy, self.spp
        out: list[Any] = []
        for idx in batch:
            actions = policy.on_trajectory_finished(idx // spp, r)
            if actions:
                out.extend(actions)
        if out:
            self._execute(out)

    def _flush_reports(self, r: int) -> None:
        """Everything replica ``r`` finished reaches the policy now: its report on the way, then what its poll holds
        (before a migration from ``r``, whose export reply carries them in the runtime)."""
        batch = self.reports.pop(self.report_out[r], []) + self.unreported[r]
        self.report_out[r] = self.linger_timer[r] = 0
        self.unreported[r] = []
        self._tell(r, batch)

    def _enqueue(self, r: int, items: list[tuple[int, float]]) -> None:
        """Trajectories ``(idx, tokens generated so far)`` join replica ``r``'s queue in order; each runs as soon as a
        slot is free."""
        if self.ranked:
            rn, rw, t_rank = self.rn, self.rw, self.t_rank
            first: i64 = r * self.dp
            end = first + self.dp
            for idx, _ in items:  # vLLM's DP load balancer: the lowest 4 * waiting + running, the first on a tie
                best = first
                best_score = 4 * rw[first] + rn[first]
                for k in range(first + 1, end):
                    score = 4 * rw[k] + rn[k]
                    if score < best_score:
                        best = k
                        best_score = score
                rw[best] += 1
                t_rank[idx] = best - first
        self.e_wait[r].extend(items)
        self._start_waiting(r)

    def _start_waiting(self, r: int) -> None:
        if self.suspended:
            return  # a stopped replica starts nothing (its KV re-prefills would run while the trainer holds it)
        if self.ranked:
            self._start_waiting_ranks(r)
            return
        h, waiting = self.e_heap[r], self.e_wait[r]
        pos, cap, sum_start = self.e_pos[r], self.cap, self.e_sum_start[r]
        vcount = self.e_vcount[r] if self.multi else None
        kv_limited, prompt = self.kv_limited, self.prompt
        refill = 0.0
        refilled = 0
        while waiting and len(h) < cap:
            idx, generated = waiting[0]
            if kv_limited and len(h) and len(h) * (prompt + pos) - sum_start + prompt + generated > self.kv_admit:
                break  # no room in the KV cache: wait for a finish
            waiting.popleft()
            start, again = self._start(idx, generated, pos, h, vcount)
            sum_start += start
            if again > 0.0:
                refill += again
                refilled += 1
        self.e_sum_start[r] = sum_start
        self._refill(r, refill, refilled)

    def _start(self, idx: int, generated: float, pos: float, h: SeqHeap,
               vcount: dict[int, int] | None) -> tuple[float, float]:
        """Start waiting sequence ``idx`` (``generated`` tokens so far) on a replica at position ``pos``, heap ``h``:
        (its start position, the tokens whose KV cache it recomputes: 0 unless it was preempted)."""
        again = 0.0
        if self.kv_limited:
            self.sched_stamp[idx] = self.next_stamp()
            if idx in self.recompute:
                self.recompute.discard(idx)
                again = self.prompt + generated
                self.recomputed_sequences += 1
        start = pos - generated if generated else pos + self.ingest_steps
        h.push(start + self.t_len[idx], idx)
        if vcount is not None:
            v = self.policy.group_version[idx // self.spp]
            vcount[v] = vcount.get(v, 0) + 1
        return start, again

    def _refill(self, r: int, refill: float, refilled: int) -> None:
        """Replica ``r`` recomputes the KV cache of ``refilled`` sequences that start again, ``refill`` tokens."""
        if refill > 0.0:
            self.recomputed_tokens += refill
            now = self.now
            begin = max(self.e_t[r], now)
            duration = self.timing.prefill_s(round(refill), refilled)
            self.e_t[r] = begin + duration
            self.m.engine_busy(r, begin, duration, now)

    def _start_waiting_ranks(self, r: int) -> None:
        """``_start_waiting`` for a replica of several ranks: each rank starts its own waiting sequences, in the queue's
        order, while it has a slot and KV room (the replica's slots bound the total, as the policy counts them)."""
        h, waiting = self.e_heap[r], self.e_wait[r]
        if not waiting:
            return
        pos, cap, sum_start = self.e_pos[r], self.cap, self.e_sum_start[r]
        rn, rss, rw, t_rank = self.rn, self.rss, self.rw, self.t_rank
        vcount = self.e_vcount[r] if self.multi else None
        kv_limited, prompt, rank_cap, admit = self.kv_limited, self.prompt, self.rank_cap, self.rank_kv_admit
        self.e_capped[r] = capped = len(h) >= cap
        if capped:
            return
        first: i64 = r * self.dp
        end = first + self.dp
        base = prompt + pos
        for k in range(first, end):  # the queue is not scanned when no rank with waiting sequences has room for one
            n = rn[k]
            if rw[k] and (n == 0 or (n < rank_cap and not (kv_limited and float(n) * base - rss[k] + prompt > admit))):
                break
        else:
            return
        blocked = 0  # bit k: rank k's queue waits for a finish there
        kept: list[tuple[int, float]] = []
        refill = 0.0
        refilled = 0
        for item in waiting:
            idx, generated = item
            rank = t_rank[idx]
            if (blocked >> rank) & 1 or len(h) >= cap:
                kept.append(item)
                if len(h) >= cap:
                    self.e_capped[r] = True
                continue
            k = first + rank
            n = rn[k]
            if n >= rank_cap or (kv_limited and n and float(n) * base - rss[k] + prompt + generated > admit):
                blocked |= 1 << rank
                kept.append(item)
                continue
            start, again = self._start(idx, generated, pos, h, vcount)
            if again > 0.0:
                refill += again
                refilled += 1
            sum_start += start
            rss[k] += start
            rn[k] = n + 1
            rw[k] -= 1
        if len(kept) < len(waiting):
            waiting.clear()
            waiting.extend(kept)
        self.e_sum_start[r] = sum_start
        self._refill(r, refill, refilled)

    def _preempt(self, r: int) -> None:
        """Replica ``r``'s running context reached its KV cache: put the sequences it scheduled last back at the front
        of its queue, as few as bring the context under the cache (at least one; never the last one running)."""
        self._advance(r, self.now)
        h, pos, prompt, t_len = self.e_heap[r], self.e_pos[r], self.prompt, self.t_len
        pairs = h.pairs()
        ctx = len(pairs) * (prompt + pos) - self.e_sum_start[r]
        kv_cap = self.kv_cap
        candidates = pairs
        rank = -1
        k = 0
        if self.ranked:  # the rank whose context reached its cache preempts its own sequences
            rank = self.e_cross_rank[r]
            k = r * self.dp + rank
            t_rank = self.t_rank
            candidates = [pair for pair in pairs if t_rank[pair[1]] == rank]
            ctx = len(candidates) * (prompt + pos) - self.rss[k]
            kv_cap = self.rank_kv_cap
        stamp = self.sched_stamp
        stamps = [stamp[idx] for _, idx in candidates]
        out: set[int] = set()
        sum_start = self.e_sum_start[r]
        waiting = self.e_wait[r]
        vcount = self.e_vcount[r] if self.multi else None
        while len(candidates) - len(out) > 1 and not (out and ctx <= kv_cap):
            # the latest scheduled of the candidates left (stamps are unique): a preemption takes one or a few, so
            # picking each is cheaper than sorting them all
            latest, best = 0, stamps[0]
            for j in range(1, len(stamps)):
                if stamps[j] > best:
                    latest, best = j, stamps[j]
            stamps[latest] = -1
            finish, idx = candidates[latest]
            start = finish - t_len[idx]
            generated = pos - start if pos > start else 0.0
            ctx -= prompt + generated
            sum_start -= start
            if rank >= 0:
                self.rn[k] -= 1
                self.rss[k] -= start
                self.rw[k] += 1
            out.add(idx)
            waiting.appendleft((idx, generated))
            if generated > 0.0:
                self.recompute.add(idx)
            if vcount is not None:
                vcount[self.policy.group_version[idx // self.spp]] -= 1
        self.preemptions += len(out)
        self.e_sum_start[r] = sum_start
        h.clear()
        for finish, idx in pairs:
            if idx not in out:
                h.push(finish, idx)
        self.dirty.add(r)

    def _record_finish(self, idx: int, r: int, length: int) -> None:
        gid, sample = divmod(idx, self.spp)
        spans = self.t_spans.get(idx)
        if spans is None:
            span_list = [[self.policy.group_version[gid], length]]
        else:
            span_list = []
            for i, (v, first) in enumerate(spans):
                end = spans[i + 1][1] if i + 1 < len(spans) else length
                span_list.append([v, end - first])
        self.trace.append(
            {"t": self.now, "type": "finished", "traj": f"g{gid}/{sample}", "rollout_group": r,
             "num_tokens": length, "spans": span_list}
        )

    # ------------------------------------------------------------------ actions
    def _execute(self, actions: Any) -> None:
        for act in actions:
            if isinstance(act, Admit):
                self._admit(act)
            elif isinstance(act, LoadWeights):
                self._load(act)
            elif isinstance(act, StartTrainStep):
                if not self.publishing:
                    self._train(act)
                elif self.train_queued is None:
                    self.train_queued = act
                else:
                    raise ValueError(f"StartTrainStep({act.step}) while step {self.train_queued.step} waits")
            elif isinstance(act, PublishWeights):
                self.publishing = True
                self.m.publish_started(self.now, self.timing.weight_publish_s)
                self._push(self.now + self.timing.weight_publish_s, _EV_PUBLISHED, act.version)
            elif isinstance(act, MigrateRequests):
                self._migrate(act)
            elif isinstance(act, DropVersion):
                self._drop(act)
            elif isinstance(act, SuspendRollout):
                self._suspend()
            elif isinstance(act, ResumeRollout):
                self._resume()
            else:
                raise TypeError(f"unknown action {act!r}")

    def _swap_s(self, r: int) -> float:
        """Moving replica ``r``'s weights and its sequences' KV cache between device and host memory, one way."""
        h, pos = self.e_heap[r], self.e_pos[r]
        ctx = len(h) * (self.prompt + pos) - self.e_sum_start[r]  # running: prompt + tokens generated so far
        ctx += sum(self.prompt + generated for idx, generated in self.e_wait[r] if idx not in self.recompute)
        timing = self.timing
        return (timing.swap_fixed_s + timing.swap_s_per_version * self.m.hosted_versions(r)
                + timing.swap_s_per_token * max(0.0, ctx))

    def _suspend(self) -> None:
        """Stop every replica (after its load or KV send in progress) and move it to host memory (module doc)."""
        if self.suspended:
            raise ValueError("SuspendRollout while rollout is suspended")
        now, end = self.now, self.now
        for r in range(len(self.e_heap)):
            self._advance(r, now)
            self.e_event[r] = 0  # supersede its pending finish: it decodes no more until resumed
            swap = self._swap_s(r)
            self.swap_s_total += swap
            end = max(end, max(self.e_t[r], self.e_stage_end[r], now) + swap)
        self.suspended = True
        self.suspend_wall_s_total += end - now
        if self.watch_decoding:
            self._check_concurrency()
        self._push(end, _EV_SUSPENDED, 0)

    def _resume(self) -> None:
        """Every replica moves its weights and KV cache back and decodes again as soon as it has (module doc)."""
        if not self.suspended:
            raise ValueError("ResumeRollout while rollout runs")
        now, end = self.now, self.now
        self.suspended = False
        for r in range(len(self.e_heap)):
            swap = self._swap_s(r)
            self.swap_s_total += swap
            self.e_t[r] = max(self.e_t[r], now) + swap
            end = max(end, self.e_t[r])
            if self.e_wait[r]:  # what a finish freed room for while stopped starts now, after the swap-in
                self._start_waiting(r)
            self.dirty.add(r)
        self.suspend_wall_s_total += end - now
        self._push(end, _EV_RESUMED, 0)

    def _drop(self, act: DropVersion) -> None:
        r, v = act.rollout_group, act.version
        if not self.multi:
            raise ValueError(f"DropVersion v{v} on engine {r}, which holds one version")
        running = self.e_vcount[r].get(v, 0)
        queued = sum(1 for idx, _ in self.e_wait[r] if self.policy.group_version[idx // self.spp] == v)
        if running or queued:
            raise ValueError(f"DropVersion v{v} on engine {r} with {running} running and {queued} queued requests of it")
        self.e_vcount[r].pop(v, None)
        self.m.engine_dropped(r, v)
        if self.record:
            self.trace.append({"t": self.now, "type": "version_dropped", "rollout_group": r, "version": v})

    def _admit(self, act: Admit) -> None:
        r, gid, n = act.rollout_group, act.group_id, act.num_samples
        if act.version != self.policy.latest_version:  # one-step-off: an older version is live again
            self.m.live_versions_changed(self.now, self.policy.live_versions())
        if gid != len(self.group_left) or n != self.spp:
            raise ValueError(f"policy admitted group {gid} x{n}; expected group {len(self.group_left)} x{self.spp}")
        if self.e_version[r] != act.version or self.e_paused[r]:
            raise ValueError(f"group {gid} admitted on v{act.version} to engine {r} serving v{self.e_version[r]}")
        now = self.now
        self._advance(r, now)
        base = gid * n
        if base + n > len(self.t_len):
            self.lengths.draw(base + n)
        lengths = self.t_len[base:base + n]
        self.group_left.append(n)
        if self.ranked:
            while len(self.t_rank) < base + n:
                self.t_rank = append(self.t_rank, 0)
        h, waiting = self.e_heap[r], self.e_wait[r]
        if not waiting and len(h) + n <= self.cap and not self.kv_limited and not self.ranked:
            # what _enqueue does when every sample fits: each starts now, at e_pos[r] (0 tokens generated)
            pos, sum_start = self.e_pos[r], self.e_sum_start[r]
            start = pos + self.ingest_steps
            for i, length in enumerate(lengths):
                h.push(start + length, base + i)
                sum_start += start
            self.e_sum_start[r] = sum_start
            if self.multi:
                v = act.version
                self.e_vcount[r][v] = self.e_vcount[r].get(v, 0) + n
        else:
            self._enqueue(r, [(base + i, 0) for i in range(n)])
        prefill = self.prompt_prefill_s
        if prefill > 0.0:
            start = max(self.e_t[r], now)
            self.e_t[r] = start + prefill
            self.m.engine_busy(r, start, prefill, now)
        if self.record:
            self.trace.extend(
                {"t": now, "type": "admitted", "traj": f"g{gid}/{i}", "version": act.version, "rollout_group": r}
                for i in range(n)
            )
        self.dirty.add(r)

    def _load(self, act: LoadWeights) -> None:
        r = act.rollout_group
        now = self.now
        self._advance(r, now)
        h = self.e_heap[r]
        keep = act.keep_loaded and self.multi
        if (len(h) or self.e_wait[r]) and not act.resume_in_flight and not keep:
            raise ValueError(f"LoadWeights v{act.version} on engine {r} with {len(h)} requests in flight")
        if self.e_wait[r] and not keep and not self.kv_limited:
            raise ValueError(f"LoadWeights v{act.version} resuming engine {r} with queued requests (no queue here)")
        duration = self.timing.weight_load_peer_s if act.source == "peer" else self.timing.weight_load_trainer_s
        start = now if keep else max(self.e_t[r], now)  # in place: after the prefill or KV send it waits behind
        if self.record:
            self.trace.append(
                {"t": start, "type": "weights_load_started", "rollout_group": r, "version": act.version,
                 "source": act.source}
            )
        if keep:  # staged while the replica decodes; served from the end of the load
            self.e_stage_end[r] = now + duration
            self.m.load_started(r, now, duration)
            self._push(now + duration, _EV_LOADED, r, act.version)
            return
        if len(h):
            pos = self.e_pos[r]
            ctx = 0.0
            for finish, idx in h.pairs():
                first = pos - (finish - self.t_len[idx])
                spans = self.t_spans.get(idx)
                if spans is None:
                    gid = idx // self.spp
                    spans = self.t_spans[idx] = [(self.policy.group_version[gid], 0)]
                spans.append((act.version, round(first)))
                ctx += self.prompt + first
            duration += self.timing.prefill_s(round(ctx), len(h))  # recompute KV on the new weights
        for idx, generated in self.e_wait[r]:  # preempted (KV-limited): they continue on the new weights too
            spans = self.t_spans.get(idx)
            if spans is None:
                spans = self.t_spans[idx] = [(self.policy.group_version[idx // self.spp], 0)]
            spans.append((act.version, round(generated)))
        self.m.load_started(r, start, duration)
        self.m.engine_unloading(r)
        self.e_paused[r] = True
        self.e_t[r] = start + duration
        self.e_event[r] = 0
        self._push(start + duration, _EV_LOADED, r, act.version)

    def _loaded(self, r: int, version: int) -> None:
        staged = not self.e_paused[r]  # loaded beside the running batch, which keeps its versions
        if staged:
            self._advance(r, self.now)
        else:
            self.e_paused[r] = False
            self.e_t[r] = self.now
        self.m.load_finished(r)
        self.m.engine_loaded(r, version, keep_others=staged)
        self.e_version[r] = version
        if self.record:
            self.trace.append({"t": self.now, "type": "weights_loaded", "rollout_group": r, "version": version})
        self.dirty.add(r)
        self._execute(self.policy.on_weights_loaded(r, version))

    def _migrate(self, act: MigrateRequests) -> None:
        src, now = act.src, self.now
        if self.multi:
            raise ValueError("MigrateRequests with multi-version engines")
        if self.delayed:
            self._flush_reports(src)
        self._advance(src, now)
        h_src, pos_src = self.e_heap[src], self.e_pos[src]
        t_len = self.t_len
        # (trajectory, tokens generated): running, soonest finish first (the heap's pop order); queued
        items = [(idx, max(0.0, pos_src - (finish - t_len[idx]))) for finish, idx in sorted(h_src.pairs())]
        h_src.clear()
        items.extend(self.e_wait[src])
        self.e_wait[src].clear()
        if self.ranked:  # they join the ranks of their destinations (_enqueue)
            for k in range(src * self.dp, (src + 1) * self.dp):
                self.rn[k] = 0
                self.rss[k] = 0.0
                self.rw[k] = 0
        moves: list[tuple[int, int]] = []
        moved_ctx = 0.0
        caps = list(act.capacity)
        i = 0
        for dst, cap in caps:
            if i >= len(items):
                break
            self._advance(dst, now)
            batch = items[i:i + cap]
            i += len(batch)
            kv_less = {idx for idx, _ in batch if idx in self.recompute}  # preempted at the source: no KV to send
            self._enqueue(dst, batch)
            # what the destination's cache cannot hold now waits there without its KV (not sent: recomputed when it
            # starts); the others' KV is sent
            queued = {idx for idx, _ in self.e_wait[dst]} if self.kv_limited else set()
            for idx, generated in batch:
                if idx in kv_less:
                    continue
                if idx in queued:
                    if generated > 0.0:
                        self.recompute.add(idx)
                    continue
                moved_ctx += self.prompt + generated
            moves.append((dst, len(batch)))
            self.dirty.add(dst)
            if self.record and batch:
                ids = [f"g{idx // self.spp}/{idx % self.spp}" for idx, _ in batch]
                self.trace.append({"t": now, "type": "migrated", "src": src, "dst": dst, "trajs": ids})
        if i < len(items):
            raise ValueError(f"MigrateRequests from engine {src}: capacity {caps} leaves {len(items) - i} requests")
        self.e_sum_start[src] = 0.0
        self.migrated += sum(c for _, c in moves)
        send = self.timing.kv_migration_s_per_token * moved_ctx
        start = max(self.e_t[src], now)
        self.e_t[src] = start + send
        self.m.engine_busy(src, start, send, now)
        self.dirty.add(src)
        self._execute(self.policy.on_requests_migrated(src, tuple(moves)))

    def _train(self, act: StartTrainStep) -> None:
        """Start step ``act.step``. An early step's groups still generating (``act.joining``) join it as they finish
        (``_joined``); the trainer trains the others first. Each joining group's share of the step's work, in
        proportion to its tokens, waits for it; after the last one the step still has at least that group's work
        as a step of its own (its microbatches through the pipeline, and the optimizer step)."""
        step, gids, spp = act.step, act.group_ids, self.spp
        tokens, sq, prompt, t_len = 0, 0.0, self.prompt, self.t_len
        group_left, waiting = self.group_left, self.train_waiting
        for g in act.joining:
            if group_left[g]:
                waiting.add(g)
        for g in gids:
            if group_left[g] and g not in waiting:
                raise ValueError(f"step {step} consumes group {g} with {group_left[g]} unfinished samples")
            for length in t_len[g * spp:(g + 1) * spp]:
                tokens += prompt + length
                sq += (prompt + length) ** 2  # whole numbers: exact in any order while below 2**53
        work = self.timing.train_step_s(tokens, sq, len(gids) * spp)
        if waiting:
            for g in waiting:
                g_tokens, g_sq = 0, 0.0
                for length in t_len[g * spp:(g + 1) * spp]:
                    g_tokens += prompt + length
                    g_sq += (prompt + length) ** 2
                share = work * g_tokens / tokens
                self.join_work[g] = (share, self.timing.train_step_s(g_tokens, g_sq, spp))
                work -= share
        contended = self.train_contention != 1.0 and self._decoding() > 0
        duration = work * self.train_contention if contended else work
        self.train_left, self.train_t, self.train_contended = work, self.now, contended
        self.train_token += 1
        self.train_step = step
        self._set_training(True)
        versions = [self.policy.group_version[g] for g in gids]
        self.m.train_started(
            step=step, now=self.now, duration_s=duration, group_ids=gids, versions=versions, spp=spp, tokens=tokens
        )
        self.m.live_versions_changed(self.now, self.policy.live_versions())
        self._push(self.now + duration, _EV_TRAINED, step, self.train_token)
        if self.record:
            consumed = [f"g{g}/{i}" for g in gids for i in range(spp)]
            self.train_trace = {"t": self.now + duration, "type": "train_step", "step": step, "start_t": self.now,
                                "consumed": consumed, "produced_version": step}
            if waiting:
                self.train_trace["joined"] = {}
            self.trace.append(self.train_trace)

    def _joined(self, g: int) -> None:
        """Group ``g`` of the running early step finished: the trainer takes its share of the step's work now (from
        where it is, or from idle)."""
        self.train_waiting.discard(g)
        share, alone = self.join_work.pop(g)
        if self.record:
            joined = self.train_trace["joined"]
            for i in range(self.spp):
                joined[f"g{g}/{i}"] = self.now
        idle = self.train_idle_t >= 0.0
        if idle:
            self.m.train_idled(self.train_step, self.now - self.train_idle_t)
            self.train_idle_t = -1.0
            left = share
            self._set_training(True)
        else:
            rate = self.train_contention if self.train_contended else 1.0
            left = max(0.0, self.train_left - (self.now - self.train_t) / rate) + share
        if not self.train_waiting:
            left = max(left, alone)
        self.train_left = left
        self.train_t = self.now
        self.train_token += 1
        contended = self.train_contention != 1.0 and self._decoding() > 0
        self.train_contended = contended
        end = self.now + left * (self.train_contention if contended else 1.0)
        if idle:
            self.m.trainer_busy(self.now, end - self.now)
        else:
            self.m.train_retimed(end)
        self._push(end, _EV_TRAINED, self.train_step, self.train_token)
        if self.record:
            self.train_trace["t"] = end

    def _set_training(self, on: bool) -> None:
        """Start or end a training step."""
        self.training = on
        self._set_slowdown()

    def _decoding(self) -> int:
        """Replicas decoding now."""
        decoding = 0
        if not self.suspended:
            for h, paused in zip(self.e_heap, self.e_paused, strict=True):
                if len(h) and not paused:
                    decoding += 1
        return decoding

    def _check_concurrency(self) -> None:
        """Note whether two or more replicas decode now (they slow each other by ``engine_contention``), and whether
        any does while a step trains (it runs ``train_contention`` times slower meanwhile)."""
        decoding = self._decoding()
        if (decoding > 1) != self.concurrent and self.engine_contention != 1.0:
            self.concurrent = decoding > 1
            self._set_slowdown()
        if self.training and self.train_contention != 1.0 and (decoding > 0) != self.train_contended:
            self._retime_training(decoding > 0)

    def _retime_training(self, contended: bool) -> None:
        """The running training step's rate changes now: its work left so far, and a new end (superseding the
        pending one)."""
        rate = self.train_contention if self.train_contended else 1.0
        self.train_left = max(0.0, self.train_left - (self.now - self.train_t) / rate)
        self.train_t, self.train_contended = self.now, contended
        end = self.now + self.train_left * (self.train_contention if contended else 1.0)
        self.train_token += 1
        self._push(end, _EV_TRAINED, self.train_step, self.train_token)
        self.m.train_retimed(end)
        if self.record:
            self.train_trace["t"] = end

    def _set_slowdown(self) -> None:
        """Set the factor on decode steps from the contentions in effect; when it changes, every replica's step
        time changes from now on."""
        slowdown = ((self.rollout_contention if self.training else 1.0)
                    * (self.engine_contention if self.concurrent else 1.0))
        if slowdown != self.slowdown:
            self.slowdown = slowdown
            for r in range(len(self.e_heap)):
                self._advance(r, self.now)
                self.dirty.add(r)

    def _trained(self, step: int) -> None:
        self._set_training(False)
        if self.train_waiting:  # an early step's trainer ran out of work: it waits for the next joining group
            self.train_idle_t = self.now
            return
        self.m.train_finished(step, self.now)
        self._execute(self.policy.on_train_step_finished(step))

    def _published(self, version: int) -> None:
        self.publishing = False
        self.m.published(version, self.now)
        if self.record:
            self.trace.append({"t": self.now, "type": "weights_published", "version": version})
        queued = self.train_queued
        if queued is not None:  # the trainer goes on from the publish to the step queued behind it
            self.train_queued = None
            self._train(queued)
        self._execute(self.policy.on_weights_published(version))
        self.m.live_versions_changed(self.now, self.policy.live_versions())

    # ------------------------------------------------------------------ end of run
    def _finish(self) -> SimResult:
        end = self.now
        for r in range(len(self.e_heap)):
            self._advance(r, end)
        # every admitted trajectory not consumed is explicitly accounted for
        consumed: set[int] = set()
        for gids in self.m.consumed_groups:
            consumed.update(gids)
        in_flight = {idx for h in self.e_heap for _, idx in h.pairs()}
        in_flight.update(idx for waiting in self.e_wait for idx, _ in waiting)
        unfinished = 0
        for gid in range(len(self.group_left)):
            if gid in consumed:
                continue
            for i in range(self.spp):
                unfinished += 1
                if self.record:
                    idx = gid * self.spp + i
                    self.trace.append(
                        {"t": end, "type": "unfinished_at_end", "traj": f"g{gid}/{i}",
                         "finished": idx not in in_flight}
                    )
        mixed = sum(1 for idx, spans in self.t_spans.items() if _mixes(spans, self.t_len[idx]))
        if self.record:
            self.trace.sort(key=lambda e: e["t"])  # stable: equal times keep emission order
        return self.m.result(
            mode=self.cfg.mode,
            seed=self.seed,
            end_s=end,
            batch_samples=self.cfg.batch_samples,
            extra_weight_bytes_per_group=(self.cfg.max_versions_per_engine - 1) * self.timing.weight_bytes_per_group,
            mixed_trajectories=mixed,
            migrated_trajectories=self.migrated,
            unfinished_at_end=unfinished,
            events=tuple(self.trace) if self.record else None,
            swap_s_total=self.swap_s_total,
            suspend_wall_s_total=self.suspend_wall_s_total,
            preemptions=self.preemptions,
            recomputed_sequences=self.recomputed_sequences,
            recomputed_tokens=self.recomputed_tokens,
        )
