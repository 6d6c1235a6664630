"""``streaming``: DORA's multi-version streaming rollout.

Invariants (each engine replica = one rollout group hosting exactly one version):
- new prompt groups start only on the newest published version;
- an in-flight trajectory finishes on the version it started with: when an engine of an older
  version is reassigned, its requests migrate with their KV cache to engines of the same version
  (never re-generated), and only then does it load the newest weights (from a peer if one serves
  them, else from the trainer);
- at most ``k + 1`` versions are live: admission is bounded so step ``v + k + 1`` consumes every
  group of version ``v`` (see ``planner.policies.base``); the trainer consumes finished groups oldest
  version first, and its only stall is waiting for the oldest version's tail at the bound.

Reassignment (DORA): with ``R_w`` the requests of live version ``w`` and ``D`` replicas in total,
version ``w`` should hold ``DP_w = round(D * R_w / sum_w R_w)`` replicas. For the newest version,
``R`` counts its in-flight requests plus the admissions the bound still allows (its demand). An
older version never drops below ``ceil(R_w / consolidation_batch)`` replicas, and is shrunk one
replica at a time, the least-loaded first, when the others can absorb its requests.

Consolidation packs an older version's requests only up to ``PolicyConfig.consolidation_batch`` per
engine (the planner sets it at the engine's batching knee at a tail's context, ``RolloutCostModel.batching_knee``,
and no higher than the engine's KV cache holds of such tails, ``Space.ctx_tail``).
Packing is what frees replicas for the newest version, but a fuller batch decodes every one of its
requests more slowly, and those requests are the tails the trainer later waits for at the bound.
Below the knee a decode step is dominated by batch-independent costs (weights, overheads), so packing
is nearly free; above it, each added request slows the whole batch about in proportion.
Every older version is packed to the same knee, the one the trainer waits for next included: packing that one to
half the knee (its tails then decode at most 1.5x slower than alone instead of 2x) sped up the first few steps but
cost the 235B MoE example 3% of its steady-state throughput and the others nothing (``bench/due_packing.py``).

Multi-version engines (``max_versions_per_engine = V > 1``, small models): an engine hosts up to
``V`` versions at once, so it never has to drain or migrate before serving newer weights. When a
version is published, every ready engine hosting fewer than ``V`` versions with requests adds it
(``LoadWeights(keep_loaded=True)``; from a peer when one serves it) and its old requests keep
running on their own weights; an engine already at ``V`` busy versions adds it as soon as one of
them drains. New groups start only on the newest version, each trajectory still runs on one
version, and a version is dropped from an engine (``DropVersion``) once no request of it remains
there. No migration: the old versions drain in place, next to the new one.

Colocated (``PolicyConfig.colocated``: rollout and training take turns on the same accelerators): rollout streams
as above until a training step is ready; then every engine stops with its in-flight requests, which keep their
tokens, KV cache and version (``SuspendRollout``); the step trains on all the accelerators and publishes; then
rollout resumes (``ResumeRollout``) and what a publish does on separate accelerators happens: empty engines load the
newest version, older versions shrink. No request is drained, dropped or regenerated at a step: the tails that stall
a colocated sync step continue on their own version in the next rollout turn. If enough groups finished for the
next step too, it trains at once and rollout stays stopped.

Admission queue (``PolicyConfig.admission_queue``, two groups on the ``cpu`` accelerator): an engine is
given up to ``slots + admission_queue`` requests; the engine runs ``slots`` of them and starts a queued
one as soon as a slot frees, without waiting for the controller (see ``admission_queue_for``).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.policies.base import CHANGING, NO_ACTIONS, RUNNING, PolicyBase
from planner.policies.config import PolicyConfig
from planner.policies.vocabulary import Action, DropVersion, LoadWeights, MigrateRequests, ResumeRollout


class StreamingPolicy(PolicyBase):
    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        n = config.num_rollout_groups
        self.num_engines = n
        self.slots = config.slots_per_group + config.admission_queue
        """Requests an engine may hold: its running slots plus the admission queue (``admission_queue_for``)."""
        self.version_active: dict[int, int] = {0: 0}
        """version -> in-flight trajectories on engines of that version."""
        self.version_engines: dict[int, set[int]] = {0: set(range(n))}
        """version -> the engines serving or loading it."""
        self.peer_hint: dict[int, int] = {0: 0}
        """version -> the lowest-numbered ready engine serving it when that is still true, -1 for none
        (``_ready_peer``)."""
        self.engine_reserved = [0] * n
        """Slots promised to an in-progress migration."""
        self.migrating: dict[int, tuple[tuple[int, int], ...]] = {}
        self.recheck_below: dict[int, int] = {}
        """version -> only retry a failed shrink once its in-flight count is below this."""
        self.pack_to = min(self.slots, config.consolidation_batch or self.slots)
        """Requests an engine may hold after taking in an older version's migrated requests."""
        self.max_versions = config.max_versions_per_engine
        self.multi = self.max_versions > 1
        self.hosted: list[dict[int, int]] = [{0: 0} for _ in range(n)]
        """Multi-version engines only: engine -> {hosted version: its in-flight trajectories there}."""

    # ------------------------------------------------------------------ driver entry points
    def start(self) -> Sequence[Action]:
        out: list[Action] = []
        for r in range(self.num_engines):
            self._fill(r, out)
        return out

    def _after_finish(self, group_id: int, rollout_group: int, group_done: bool) -> Sequence[Action]:
        r = rollout_group
        if self.multi:
            return self._after_finish_multi(group_id, r, group_done)
        w = self.engine_version[r]  # the trajectory's version: a single-version engine only holds its own
        self.version_active[w] -= 1
        if self.suspended:
            return NO_ACTIONS  # stopped engines take no action; ``on_rollout_resumed`` looks at every one
        out: list[Action] | None = None
        if w == self.latest_version:
            if self.engine_ready[r] and self.slots - self.engine_active[r] - self.engine_reserved[r] >= self.spp:
                out = []
                self._fill(r, out)
        elif self.engine_ready[r] and r not in self.migrating:
            if self.engine_active[r] == 0:
                out = []
                self._switch(r, out)
            elif self.version_active[w] < self.recheck_below.get(w, 1 << 62) and self._over_target(w):
                out = []
                self._shrink(w, out)
        if group_done:
            if out is None:
                out = []
            self._try_train_oldest_first(out)
        return NO_ACTIONS if out is None else out

    def on_weights_published(self, version: int) -> Sequence[Action]:
        self.latest_version = version
        if self.config.colocated:
            self.version_active.setdefault(version, 0)
            self.version_engines.setdefault(version, set())
            out_coloc: list[Action] = []
            self._try_train_oldest_first(out_coloc)  # enough finished already: train again, rollout stays stopped
            if not self.training:
                self.suspended = CHANGING
                out_coloc.append(ResumeRollout())
            return out_coloc
        return self._published(version, train=True)

    def on_rollout_resumed(self) -> Sequence[Action]:
        """Colocated: the engines serve again; what a publish does on separate accelerators happens now."""
        if self.suspended != CHANGING:
            raise ValueError("RolloutResumed without a ResumeRollout")
        self.suspended = RUNNING
        out = self._published(self.latest_version, train=False)  # multi-version engines: also fills every ready one
        if not self.multi:
            for r in range(self.num_engines):  # engines that finished requests while stopped have room again
                if self.engine_ready[r] and r not in self.migrating:
                    self._fill(r, out)
        if not self.training and not self.suspended:
            self._try_train_oldest_first(out)
        return out

    def _published(self, version: int, *, train: bool) -> list[Action]:
        """Version ``version`` is the newest: point empty engines at it and shrink the older versions' share; then
        start the next step if ``train`` and it is ready."""
        if self.multi:
            out_multi: list[Action] = []
            for r in range(self.num_engines):
                if self.engine_ready[r]:
                    self._add_newest(r, out_multi)
            if train:
                self._try_train_oldest_first(out_multi)
            return out_multi
        self.version_active.setdefault(version, 0)
        self.version_engines.setdefault(version, set())
        out: list[Action] = []
        for r in range(self.num_engines):
            if self.engine_ready[r] and self.engine_active[r] == 0 and r not in self.migrating:
                self._switch(r, out)
        for w in sorted(self.version_engines):
            if w != version:
                self.recheck_below.pop(w, None)
                while self._over_target(w) and self._shrink(w, out):
                    pass
        if train:
            self._try_train_oldest_first(out)
        return out

    def on_requests_migrated(self, src: int, moves: tuple[tuple[int, int], ...]) -> Sequence[Action]:
        planned = self.migrating.pop(src)
        for dst, cap in planned:
            self.engine_reserved[dst] -= cap
        for dst, count in moves:
            self.engine_active[dst] += count
            self.engine_active[src] -= count
        if self.engine_active[src] != 0:
            raise ValueError(f"engine {src} still has {self.engine_active[src]} requests after migration")
        if self.suspended:
            return NO_ACTIONS  # the empty engine is pointed at the newest version on resume
        out: list[Action] = []
        self._switch(src, out)
        for dst, _ in planned:  # a destination that drained while it waited, and got nothing, is empty now
            if (self.engine_ready[dst] and self.engine_active[dst] == 0 and not self.engine_reserved[dst]
                    and dst not in self.migrating and self.engine_version[dst] != self.latest_version):
                self._switch(dst, out)
        return out

    def on_weights_loaded(self, rollout_group: int, version: int) -> Sequence[Action]:
        r = rollout_group
        self.engine_ready[r] = True
        hint = self.peer_hint.get(version, -1)
        if hint < 0 or r < hint:
            self.peer_hint[version] = r
        if self.suspended:
            return NO_ACTIONS  # a load that was in progress when rollout stopped; ``on_rollout_resumed`` fills it
        out: list[Action] = []
        if self.multi and version != self.latest_version:
            self._add_newest(r, out)
        elif version != self.latest_version:
            self._switch(r, out)  # a newer version appeared while loading; the engine is still empty
        else:
            self._fill(r, out)
        return out

    # ------------------------------------------------------------------ internals
    def _free(self, r: int) -> int:
        return self.slots - self.engine_active[r] - self.engine_reserved[r]

    def _fill(self, r: int, out: list[Action]) -> None:
        v = self.latest_version
        if not self.engine_ready[r] or self.engine_version[r] != v or self.suspended:
            return
        budget = self._admission_budget()
        counts = self.hosted[r] if self.multi else self.version_active
        while budget > 0 and self._free(r) >= self.spp:
            self._admit(r, v, out)
            counts[v] += self.spp
            budget -= 1

    # ------------------------------------------------------------------ multi-version engines
    def _after_finish_multi(self, group_id: int, r: int, group_done: bool) -> Sequence[Action]:
        out: list[Action] = []
        w = self.group_version[group_id]
        hosted = self.hosted[r]
        hosted[w] -= 1
        if hosted[w] == 0 and w != self.engine_version[r]:
            del hosted[w]
            out.append(DropVersion(rollout_group=r, version=w))
        if self.suspended:
            return out
        if self.engine_ready[r]:
            if self.engine_version[r] != self.latest_version:
                self._add_newest(r, out)
            elif self._free(r) >= self.spp:
                self._fill(r, out)
        if group_done:
            self._try_train_oldest_first(out)
        return out

    def _add_newest(self, r: int, out: list[Action]) -> None:
        """Load the newest version on ready engine ``r`` beside its busy versions, if it has room for one more."""
        new = self.latest_version
        if self.engine_version[r] == new:
            self._fill(r, out)
            return
        hosted = self.hosted[r]
        busy = [v for v, n in hosted.items() if n > 0]
        if len(busy) >= self.max_versions:
            return  # retried when one of them drains
        for v in [v for v, n in hosted.items() if n == 0]:
            del hosted[v]
            if busy:  # an empty engine's LoadWeights drops everything itself
                out.append(DropVersion(rollout_group=r, version=v))
        hosted[new] = 0
        self.engine_version[r] = new
        self.engine_ready[r] = False
        peer = self._ready_peer(new)
        keep = bool(busy)
        if peer is None:
            out.append(LoadWeights(rollout_group=r, version=new, source="trainer", keep_loaded=keep))
        else:
            out.append(LoadWeights(rollout_group=r, version=new, source="peer", peer=peer, keep_loaded=keep))

    def _switch(self, r: int, out: list[Action]) -> None:
        """Point empty engine ``r`` at the newest version (peer-to-peer when a peer serves it). Not while requests
        of its old version are on their way in (``engine_reserved``: a migration the driver has not reported yet,
        whose source the runtime is still exporting); ``on_requests_migrated`` switches it if none arrived."""
        new, old = self.latest_version, self.engine_version[r]
        if old == new:
            self._fill(r, out)
            return
        if self.engine_reserved[r]:
            return
        self.version_engines[old].discard(r)
        if not self.version_engines[old] and self.version_active.get(old, 0) == 0:
            del self.version_engines[old]
            self.version_active.pop(old, None)
            self.recheck_below.pop(old, None)
        self.version_engines[new].add(r)
        self.engine_version[r] = new
        self.engine_ready[r] = False
        peer = self._ready_peer(new)
        if peer is None:
            out.append(LoadWeights(rollout_group=r, version=new, source="trainer"))
        else:
            out.append(LoadWeights(rollout_group=r, version=new, source="peer", peer=peer))

    def _ready_peer(self, v: int) -> int | None:
        """The lowest-numbered ready engine serving ``v`` (a weight source), or None.

        Every engine becomes ready on a version through ``on_weights_loaded``, which lowers the hint (or sets it
        over -1); an engine leaves a version only by loading another, which the check here notices. So a hint that
        still holds is the lowest, -1 means none, and the scan (O(engines): with thousands of replicas, each of
        them switching at every publish, the scan made a search quadratic) runs only when the hint went stale."""
        hint = self.peer_hint.get(v)
        if hint is not None:
            if hint < 0:
                return None
            if self.engine_ready[hint] and self.engine_version[hint] == v:
                return hint
        peer = next((p for p in range(self.num_engines) if self.engine_ready[p] and self.engine_version[p] == v), None)
        self.peer_hint[v] = -1 if peer is None else peer
        return peer

    def _pack_cap(self, w: int) -> int:
        """Requests an engine of older version ``w`` may hold after consolidation (the same for every ``w``; the
        seam ``bench/due_packing.py`` swaps to measure another rule)."""
        return self.pack_to

    def _over_target(self, w: int) -> bool:
        """Does old version ``w`` hold more replicas than DORA's proportional share (and than it needs)?"""
        members = self.version_engines.get(w, ())
        engines = len(members) - sum(1 for src in self.migrating if src in members) if self.migrating else len(members)
        if engines <= 1:
            return False
        active = self.version_active[w]
        need = -(-active // self._pack_cap(w))
        if engines <= need:
            return False
        newest = self.latest_version
        demand_new = self.version_active[newest] + max(0, self._admission_budget()) * self.spp
        total = sum(a for v, a in self.version_active.items() if v != newest) + demand_new
        share = round(self.num_engines * active / total) if total else 0
        return engines > max(need, share, 1)

    def _shrink(self, w: int, out: list[Action]) -> bool:
        """Move the least-loaded ready engine of ``w`` to the newest version; False if nothing fits."""
        members = [r for r in self.version_engines[w] if self.engine_ready[r] and r not in self.migrating]
        if len(members) < 2:
            self.recheck_below[w] = self.version_active[w]
            return False
        sources = [r for r in members if self.engine_reserved[r] == 0]  # not awaiting incoming requests
        if not sources:
            self.recheck_below[w] = self.version_active[w]
            return False
        src = min(sources, key=lambda r: (self.engine_active[r], r))
        need = self.engine_active[src]
        if need == 0:
            self._switch(src, out)
            return True
        capacity: list[tuple[int, int]] = []
        pack_to = self._pack_cap(w)
        for dst in sorted(members, key=lambda r: (self._free(r), r), reverse=True):
            if dst == src or need == 0:
                continue
            take = min(self._free(dst), pack_to - self.engine_active[dst] - self.engine_reserved[dst], need)
            if take > 0:
                capacity.append((dst, take))
                need -= take
        if need > 0:
            self.recheck_below[w] = self.version_active[w] - self.spp + 1
            return False
        self.recheck_below.pop(w, None)
        for dst, take in capacity:
            self.engine_reserved[dst] += take
        self.migrating[src] = tuple(capacity)
        out.append(MigrateRequests(src=src, capacity=tuple(capacity)))
        return True
