"""The plan search: optimality against exhaustive simulation, pins, modes, infeasibility, determinism."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_lower_plans import example_planned  # the example specs' plans, made once for the whole run

from dora.planning import make_plan, search_inputs
from dora.spec import load_spec, load_spec_text
from planner.search import InfeasibleError, search
from planner.search.core import Space, simulate_candidate

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "specs"

SMALL_GPU = """
name: small-gpu
model: {preset: qwen3-8b}
cluster: {accelerator: h100, nodes: 2, accelerators_per_node: 8}
workload:
  prompts_per_step: 32
  samples_per_prompt: 8
  prompt_length: {median_tokens: 200, p99_tokens: 600, max_tokens: 1024}
  response_length: {median_tokens: 600, p99_tokens: 6000, max_tokens: 8192}
  steps: 20
staleness: {max_version_lag: 2}
runtime: {rollout_engine: vllm, trainer: megatron}
"""


def _resolved(text: str, **replace: str):
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return load_spec_text(text, "test.yaml", SPECS)


def _tiny_placed_by_planner(**replace: str):
    """specs/local-tiny.yaml with its pinned placement (``colocated: false``) left to the planner."""
    return _resolved((SPECS / "local-tiny.yaml").read_text(), **{"  colocated: false\n": "", **replace})


def _tiny_auto(**replace: str):
    """specs/local-tiny.yaml with its pinned mode and placement left to the planner (``mode: auto``)."""
    return _tiny_placed_by_planner(**{"  mode: streaming\n": "  mode: auto\n", **replace})


@pytest.mark.parametrize("case, k", [("local-tiny", 3), ("local-tiny auto", 2), ("local-tiny auto", 3),
                                      ("small-gpu", 1), ("small-gpu", 2), ("small-gpu", 3), ("small-gpu", 4)])
def test_chosen_within_a_tie_of_exhaustive_best(case: str, k: int) -> None:
    """Within the tie margin, where 3% was allowed: small-gpu chose a plan 2.7% slower (its placement led only after
    the longer runs, so its other modes were never simulated), and local-tiny's disaggregated streaming was never a
    finalist (colocated streaming took the mode's one place)."""
    from planner.search.core import TIE_FRACTION

    budget = {"max_version_lag: 3 ": f"max_version_lag: {k} "}
    resolved = (_tiny_placed_by_planner() if case == "local-tiny" else _tiny_auto(**budget)
                if case == "local-tiny auto" else _resolved(SMALL_GPU, **{"{max_version_lag: 2}":
                                                                            f"{{max_version_lag: {k}}}"}))
    inputs = search_inputs(resolved)
    chosen = search(inputs).chosen
    exhaustive = search(inputs, exhaustive=True)
    best = max(s.trained_tokens_per_s for s in exhaustive.finalists)
    assert len(exhaustive.finalists) == len(exhaustive.screened) > 4
    assert chosen.trained_tokens_per_s >= (1 - TIE_FRACTION) * best, (chosen.screened.label,
                                                                       exhaustive.chosen.screened.label)


def test_under_objective_time_the_considered_table_reasons_by_the_time_it_ranks_by() -> None:
    """The search ranks by samples/s over the whole run, but the reasons compared trained tokens/s: a plan chosen
    for its time read as a tie, and a rejected one as 'slower by -0.3%'."""
    plan = make_plan(_resolved(SMALL_GPU + "objective: time\n")).plan
    chosen = next(c for c in plan.considered if c.status == "chosen")
    assert chosen.reason.startswith("highest simulated samples/s over the whole run")
    assert not any("slower by -" in c.reason for c in plan.considered)
    assert any(c.reason.endswith("samples/s over the whole run)") for c in plan.considered if "slower by" in c.reason)


def test_plan_is_deterministic() -> None:
    resolved = _resolved(SMALL_GPU)
    assert make_plan(resolved).plan.to_json() == make_plan(resolved).plan.to_json()


def test_pinned_fields_restrict_the_space() -> None:
    pinned = make_plan(_resolved(SMALL_GPU + "placement:\n  colocated: true\n  rollout: {tp: 2}\n")).plan
    assert pinned.colocated and pinned.rollout.tp == 2 and pinned.mode == "streaming"
    free = make_plan(_resolved(SMALL_GPU)).plan
    assert free.predictions.trained_tokens_per_s > pinned.predictions.trained_tokens_per_s
    assert any("pinned placement is" in w for w in pinned.warnings)


def test_fixed_mode_and_zero_budget() -> None:
    one = make_plan(_resolved(SMALL_GPU, **{"{max_version_lag: 2}": "{max_version_lag: 1, mode: one-step-off}"}))
    assert one.plan.mode == "one-step-off"
    sync = make_plan(_resolved(SMALL_GPU, **{"{max_version_lag: 2}": "{max_version_lag: 0}"})).plan
    assert sync.mode == "sync" and sync.max_version_lag == 0
    assert {c.mode for c in search(search_inputs(_resolved(SMALL_GPU, **{"{max_version_lag: 2}": "{max_version_lag: 0}"})))
            .screened} == {"sync"}


def test_a_pinned_asynchronous_mode_is_still_measured_against_a_simulated_sync_plan() -> None:
    """With the mode pinned no sync candidate is searched; the speedup once fell back to the plan itself (1.00x)."""
    pinned = _resolved(SMALL_GPU, **{"{max_version_lag: 2}": "{max_version_lag: 2, mode: streaming}"})
    planned = make_plan(pinned)
    plan, outcome = planned.plan, planned.outcome
    base = outcome.best_sync
    assert plan.mode == "streaming" and base is not None and base.screened.mode == "sync"
    assert all(f.screened.mode == "streaming" for f in outcome.finalists)  # a baseline, never a candidate
    assert plan.predictions.speedup_vs_sync == pytest.approx(plan.predictions.trained_tokens_per_s
                                                            / base.trained_tokens_per_s)
    assert plan.predictions.speedup_vs_sync != pytest.approx(1.0, abs=0.005)
    assert 0 < plan.predictions.rollout_share < 1
    row = next(c for c in plan.considered if c.mode == "sync")
    assert row.status == "rejected" and "sync baseline" in row.reason and "pins streaming" in row.reason
    # the sync plan a search of every mode finds best
    free = search(search_inputs(_resolved(SMALL_GPU)))
    assert free.best_sync is not None and base.screened.label == free.best_sync.screened.label


def test_a_pinned_placement_is_also_measured_against_sync_on_any_placement() -> None:
    """local-tiny pins a disaggregated placement, where sync is slower than colocated: the speedup over the pinned
    baseline alone (1.66x) flattered streaming against the sync plan one would run (1.34x; measured 1.44x)."""
    planned = make_plan(load_spec(str(SPECS / "local-tiny.yaml")))
    p = planned.plan.predictions
    base = planned.outcome.best_sync
    assert base is not None and not base.screened.placement.colocated  # the pin holds the baseline too
    import re

    text = re.sub(r"^placement:\n(?:[ #].*\n)*", "", (SPECS / "local-tiny.yaml").read_text(), flags=re.M)
    unpinned = search(search_inputs(_resolved(text, **{"  mode: streaming\n": "  mode: sync\n"})))
    elsewhere = unpinned.best_sync
    assert elsewhere is not None and elsewhere.screened.placement.colocated
    assert elsewhere.trained_tokens_per_s > base.trained_tokens_per_s
    assert p.speedup_vs_sync == pytest.approx(p.trained_tokens_per_s / base.trained_tokens_per_s)
    assert p.speedup_vs_sync_any_placement == pytest.approx(p.trained_tokens_per_s / elsewhere.trained_tokens_per_s)
    assert 1 < p.speedup_vs_sync_any_placement < p.speedup_vs_sync
    row = next(c for c in planned.plan.considered if c.label == elsewhere.screened.label)
    assert row.status == "rejected" and row.mode == "sync" and "pins lifted" in row.reason
    assert f"{p.speedup_vs_sync_any_placement:.2f}x it" in row.reason
    # nothing pinned: no second baseline, the first is over every placement
    free = make_plan(_resolved(text)).plan.predictions
    assert free.speedup_vs_sync_any_placement is None


def test_the_speedup_baseline_is_the_best_of_several_sync_plans_simulated_as_long_as_the_chosen() -> None:
    """The screen misorders close sync layouts (on the 235B example its second simulates 9% faster than its first),
    and a 6-step run of a sync plan read ~4% below its 24-step run: both flattered the reported speedup."""
    from planner.search.core import SYNC_BASELINE_CANDIDATES

    outcome = search(search_inputs(_resolved(SMALL_GPU)))
    base, chosen = outcome.best_sync, outcome.chosen
    assert base is not None and base.sim_steps == chosen.sim_steps > min(s.sim_steps for s in outcome.finalists)
    syncs = [s for s in outcome.finalists if s.screened.mode == "sync"]
    assert base.trained_tokens_per_s == max(s.trained_tokens_per_s for s in syncs)
    top = [c.label for c in outcome.screened if c.mode == "sync"][:SYNC_BASELINE_CANDIDATES]
    assert set(top) <= {s.screened.label for s in syncs}


def test_a_versions_per_engine_pin_the_chosen_mode_cannot_use_is_reported() -> None:
    # responses of nearly one length and a batch that fills every slot: nothing for colocated streaming to hide, and
    # colocated sync wins
    sync = SMALL_GPU.replace("p99_tokens: 6000", "p99_tokens: 640").replace("prompts_per_step: 32", "prompts_per_step: 512")
    plan = make_plan(_resolved(sync + "placement:\n  colocated: true\n  rollout: {versions_per_engine: 3}\n")).plan
    assert plan.mode == "sync" and plan.rollout.versions_per_engine == 1
    assert any("versions_per_engine pins 3, but the chosen sync k=0 hosts 1 per engine" in w for w in plan.warnings)
    free = make_plan(_resolved(sync + "placement:\n  colocated: true\n")).plan
    assert not any("versions_per_engine" in w for w in free.warnings)


def test_partial_rollout_only_with_mixing() -> None:
    modes = {c.mode for c in search(search_inputs(_resolved(SMALL_GPU))).screened}
    assert "partial-rollout" not in modes and "streaming" in modes
    mixed = _resolved(SMALL_GPU, **{"{max_version_lag: 2}": "{max_version_lag: 2, allow_version_mixing: true}"})
    assert "partial-rollout" in {c.mode for c in search(search_inputs(mixed)).screened}


def test_infeasible_names_closest_candidate() -> None:
    text = (SPECS / "moe-235b-h800x512.yaml").read_text().replace("nodes: 64", "nodes: 1").replace(
        "accelerator: h800", "accelerator: a100-80g")
    with pytest.raises(InfeasibleError) as info:
        make_plan(load_spec_text(text, "x.yaml", SPECS))
    assert info.value.closest is not None
    assert "does not fit: needs" in str(info.value)


def test_dense_32b_report_chooses_streaming_with_speedup() -> None:
    planned = example_planned("dense-32b-h800x128")
    plan, outcome = planned.plan, planned.outcome
    # disaggregated streaming: training on 32 is trainer-bound and on 64 rollout-bound; the balanced split between
    # them needs an uneven pipeline (64 layers over pp=3: 22/22/20, the last stage's LM head on 20, with tp=2 and
    # cp=8 for the 32K-token microbatches). Colocated streaming, chosen until the last pipeline stage carried the LM
    # head (at pp=16, 4 layers and a head of 2 layers' work), is 2.5% behind it.
    assert plan.mode == "streaming" and not plan.colocated and plan.train.accelerators == 48
    assert 64 % plan.train.pp != 0
    assert plan.predictions.speedup_vs_sync > 1.38  # 1.43; 1.40 since engines keep to their KV cache (1.44 before)
    chosen = [c for c in plan.considered if c.status == "chosen"]
    assert len(chosen) == 1 and chosen[0].mode == "streaming"
    disagg = max((s for s in outcome.finalists if s.screened.mode == "streaming" and not s.screened.placement.colocated),
                 key=lambda s: s.trained_tokens_per_s)
    assert disagg.trained_tokens_per_s == chosen[0].trained_tokens_per_s
    coloc = max((s for s in outcome.finalists if s.screened.mode == "streaming" and s.screened.placement.colocated),
                key=lambda s: s.trained_tokens_per_s)
    assert 0.95 * chosen[0].trained_tokens_per_s < coloc.trained_tokens_per_s < chosen[0].trained_tokens_per_s
    simulated = [c for c in plan.considered if c.stage == "simulated"]
    best = {m: max(c.trained_tokens_per_s for c in simulated if c.mode == m) for m in ("sync", "one-step-off")}
    assert best["sync"] < best["one-step-off"] < chosen[0].trained_tokens_per_s
    assert not any("slower by -" in c.reason for c in plan.considered)
    # a perfect schedule on any placement bounds streaming; the colocated one, rollout and training in turn on all 128
    # devices at full occupancy, is the higher, and the colocated plan reaches most of it (the rest: engines of older
    # versions below full while their tails finish, as many as their KV cache holds, and the moves to and from host
    # memory): no schedule reaches 2x
    ceiling = plan.predictions.overlap_ceiling_tokens_per_s
    assert ceiling is not None and chosen[0].trained_tokens_per_s <= ceiling
    by_kind = {kind: rate for kind, rate, _ in outcome.ceiling_by_kind}
    assert ceiling == max(by_kind.values()) == by_kind["colocated"] > by_kind["disaggregated"]
    assert 0.84 * by_kind["colocated"] < coloc.trained_tokens_per_s
    assert 0.9 * by_kind["disaggregated"] < disagg.trained_tokens_per_s
    assert ceiling < 2 * outcome.best_sync.trained_tokens_per_s


@pytest.mark.parametrize("k, best", [(4, "disagg R40(tp2c22x20) T24(tp1 pp3 dp1 cp8) streaming k=4"),
                                     (5, "coloc R64(tp2c22x32) T64(tp1 pp1 dp8 cp8) streaming k=5")])
def test_the_search_finds_what_an_exhaustive_search_finds_on_dense_8b(k: int, best: str) -> None:
    """dense-8b with a budget of 4 or 5: an exhaustive search (every screened candidate simulated, 15-20 s; run on
    2026-11-24) chooses tp2 engines on a 40/24 split. The screen once ranked it 31st and 23rd, and the search chose
    3.2% and 4.6% below it until it stepped between splits in simulation; since the screen charges streaming's tail at
    its packed batch it ranks it first or second. Its trainer was pp6 cp4 until the last pipeline stage carried the
    LM head (6 layers and a head of 4 layers' work there); the exhaustive search, rerun then (2026-11-25, with the
    packing step after it), chooses pp3 cp8 at k = 4 and colocated tp2 at k = 5, both packed to 22 per engine. Those
    runs had every step wait for its whole batch; so does this one (``SearchInputs.early_steps``)."""
    resolved = _resolved((SPECS / "dense-8b-h800x64.yaml").read_text(),
                         **{"max_version_lag: 2": f"max_version_lag: {k}"})
    outcome = search(dataclasses.replace(search_inputs(resolved), early_steps=False))
    assert outcome.chosen.screened.label == best


def test_the_split_and_packing_steps_find_faster_plans_on_the_560b_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 560B example at k = 1 held to disaggregated placements (2026-11-25). Stepping between splits: the best split
    of its tp8dp16ep128 engines is a neighbour of the screen's. Stepping the packing cap of older versions up from the
    knee rule's: 64 per engine, faster again (311,233 trained tokens/s on R2816/T1280). Every step waits for its whole
    batch, as when these figures were found (``SearchInputs.early_steps``)."""
    import planner.search.core as core

    resolved = _resolved((SPECS / "moe-560b-x4096.yaml").read_text(), **{"max_version_lag: 3": "max_version_lag: 1"})
    inputs = search_inputs(resolved)
    inputs = dataclasses.replace(inputs, pins=dataclasses.replace(inputs.pins, colocated=False), early_steps=False)
    packed = search(inputs).chosen
    monkeypatch.setattr(core, "_pack_step", lambda *args: [])
    stepped = search(inputs).chosen
    monkeypatch.setattr(core, "SPLIT_STEPS", 0)
    unstepped = search(inputs).chosen
    assert stepped.screened.label == "disagg R2816(tp8dp16ep128x22) T1280(tp4 pp10 dp4 ep16 cp8) streaming k=1"
    assert unstepped.screened.placement.rollout == stepped.screened.placement.rollout
    assert unstepped.screened.placement.rollout_accelerators != stepped.screened.placement.rollout_accelerators
    assert stepped.trained_tokens_per_s > 1.05 * unstepped.trained_tokens_per_s
    ro = packed.screened.placement.rollout
    assert ro.pack_stepped and ro.consolidation_batch >= 2 * stepped.screened.placement.rollout.consolidation_batch
    assert packed.screened.label == "disagg R2816(tp8dp16ep128c64x22) T1280(tp4 pp10 dp4 ep16 cp8) streaming k=1"
    assert packed.trained_tokens_per_s > 1.05 * stepped.trained_tokens_per_s


def test_memory_reports_fit() -> None:
    plan = example_planned("dense-8b-h800x64").plan
    for m in plan.memory:
        assert 0 < m.need_bytes <= m.have_bytes


def test_proximal_forward_charged_only_with_several_optimizer_steps() -> None:
    """With one optimizer step the proximal log-probs are the training forward's own (detached), as the runtime
    trainer computes them; several minibatches or epochs need a no-grad forward first and pay per-step costs."""
    one = search_inputs(_resolved(SMALL_GPU))
    assert (one.extra_forward_passes, one.optimizer_steps) == (0, 1)
    four = search_inputs(_resolved(SMALL_GPU + "algorithm: {minibatches_per_step: 4, kl_coef: 0.01}\n"))
    assert (four.extra_forward_passes, four.optimizer_steps) == (2, 4)  # proximal + reference
    epochs = search_inputs(_resolved(SMALL_GPU + "algorithm: {ppo_epochs: 2}\n"))
    assert (epochs.extra_forward_passes, epochs.optimizer_steps) == (1 + 3, 2)


def test_a_finalist_that_ties_says_so_and_why_it_lost() -> None:
    """Within 1% of the fastest is a tie: the table says so and names the rule, never 'slower by -0.5%'."""
    import dataclasses

    from planner.search.build import _candidate_rows

    inputs = search_inputs(_tiny_auto())
    outcome = search(inputs)
    chosen = outcome.chosen
    same_k = next(s for s in outcome.finalists  # another mode: a tie of the same mode and k ranks by rate alone
                  if s.screened.mode != chosen.screened.mode and s.screened.k == chosen.screened.k)

    def tied(s, by: float):  # the same simulation, reported `by` faster than the chosen plan
        rate = chosen.trained_tokens_per_s * (1 + by) / s.scale
        return dataclasses.replace(s, sim=dataclasses.replace(s.sim, tokens_per_s=rate))

    finalists = [chosen, tied(same_k, 0.005)]
    rows = {r.label: r for r in _candidate_rows(dataclasses.replace(outcome, finalists=tuple(finalists)), inputs)}
    assert rows[chosen.screened.label].reason.startswith("ties the fastest within 1% at the lowest staleness")
    assert rows[same_k.screened.label].reason.startswith("ties within 1% (+0.5%) at the same staleness; "
                                                         f"{chosen.screened.mode} is preferred")
    assert not any("slower by -" in r.reason for r in rows.values())


LONG_PROMPTS = {"prompt_length: {median_tokens: 200, p99_tokens: 600, max_tokens: 1024}":
                "prompt_length: {median_tokens: 8000, p99_tokens: 16000, max_tokens: 32768}",
                "response_length: {median_tokens: 600, p99_tokens: 6000, max_tokens: 8192}":
                "response_length: {median_tokens: 50, p99_tokens: 200, max_tokens: 256}"}


@pytest.mark.parametrize("prompts", ["short", "long"])
def test_overlap_ceiling_bounds_every_screened_mode_and_the_simulation(prompts: str) -> None:
    """With long prompts too: the screen once charged a batch's prefill as one sequence of all its prompt tokens
    (attention quadratic in the whole batch), and a sync plan read "reaches 204%" of the ceiling."""
    from planner.search.core import Space, _placements
    from planner.search.screen import Screen

    inputs = search_inputs(_resolved(SMALL_GPU, **(LONG_PROMPTS if prompts == "long" else {})))
    space = Space(inputs)
    screen = Screen(space)
    placements = _placements(space, screen)
    assert {p.colocated for p in placements} == {True, False}
    for p in placements:
        ceiling = screen.overlap_ceiling(p)
        modes = ("sync",) if p.colocated else ("sync", "one-step-off", "bounded-async", "streaming")
        for mode in modes:
            for k in (1, 2):
                assert screen.evaluate(p, mode, k).trained_tokens_per_s <= ceiling * (1 + 1e-12)
    # the simulator, with real tails and occupancy, stays below the ceiling of its placement, in every mode
    outcome = search(inputs)
    assert {f.screened.mode for f in outcome.finalists} >= {"sync", "streaming"}
    assert any(f.screened.placement.colocated for f in outcome.finalists)
    # over the long runs: the ceiling is a steady state's, and a 6-step run of colocated streaming ends before the
    # older versions' tails pile up (coloc R16(tp2x8) streaming k=2: 6 steps 5% above its ceiling, 24 steps 12% below)
    long = max(f.sim_steps for f in outcome.finalists)
    for f in outcome.finalists:
        if f.sim_steps == long:
            assert f.trained_tokens_per_s <= 1.05 * screen.overlap_ceiling(f.screened.placement), f.screened.label
    # the reported ceiling is the best over every placement, and bounds every finalist
    assert outcome.overlap_ceiling == max((screen.overlap_ceiling(p), p.label) for p in placements)
    assert all(f.trained_tokens_per_s <= 1.05 * outcome.overlap_ceiling[0] for f in outcome.finalists)


def test_ceiling_keeps_the_staleness_budget() -> None:
    """No schedule within budget k holds more than (k + 1) batches in flight, nor trains the longest response later
    than k + 1 steps after its version: the ceiling counts both, and only the second goes with version mixing. On
    separate accelerators an early step may start before the longest response finishes: only the publish precedes
    its window there."""
    import dataclasses

    from planner.search.core import Space, _placements
    from planner.search.screen import Screen

    inputs = search_inputs(_resolved(SMALL_GPU))  # 32 x 8 = 256 samples a step, k = 2
    screen = Screen(Space(inputs))
    placements = _placements(screen.space, screen)
    wide = [p for p in placements if p.replicas * p.rollout.slots > 3 * 256]
    assert wide and {p.colocated for p in placements} == {True, False}
    for p in wide:
        assert screen.ceiling_batch(p) == 3 * 256 // p.replicas < p.rollout.slots
    for p in placements:
        sync = screen.weight_sync(p)
        train = screen.train_s(p) + sync.gather_s + sync.convert_s  # colocated: with the trainer's state moves
        assert (screen.train_s(p) > p.train.step_s) == p.colocated
        l_max = screen.expected_max_response()
        alone = l_max * screen.rollout_model(p.rollout).decode_step_s(1, screen.space.prompt_mean + l_max / 2)
        expect = train + alone / 3 if p.colocated else (alone + sync.gather_s + sync.convert_s) / 3
        assert screen.tail_bound(p) == pytest.approx(expect)
        if not p.colocated:  # every step waiting for its whole batch: the training comes before the window too
            waits = Screen(Space(dataclasses.replace(inputs, early_steps=False)))
            assert waits.tail_bound(p) == pytest.approx((alone + train) / 3)
        assert screen.space.step_tokens / screen.overlap_ceiling(p) >= screen.tail_bound(p) * (1 - 1e-12)
    # a larger budget only raises the ceiling; mixing drops the tail's bound
    for k, mixing in ((4, False), (2, True)):
        looser = Screen(Space(dataclasses.replace(inputs, max_version_lag=k, allow_version_mixing=mixing)))
        for p in placements:
            assert looser.overlap_ceiling(p) >= screen.overlap_ceiling(p) * (1 - 1e-12)
            assert (looser.tail_bound(p) == 0) == mixing


def test_screen_and_ceiling_count_trained_tokens_as_the_simulator_does() -> None:
    """Prompt + response tokens everywhere: a ceiling that counted responses only sat ~10% low on dense-32b."""
    from planner.search.core import Space
    from planner.search.screen import Screen

    inputs = search_inputs(_resolved(SMALL_GPU + "placement:\n  colocated: false\n"))
    space = Space(inputs)
    chosen = search(inputs).chosen
    s = chosen.screened
    assert space.prompt_mean > 0.1 * (space.prompt_mean + space.response_mean)  # large enough to tell the two apart
    assert s.trained_tokens_per_s * s.step_time_s == pytest.approx(space.step_tokens)
    # the simulation's steady steps train the mean sample's tokens, within sampling noise
    assert chosen.trained_tokens_per_s * chosen.sim.step_time_s == pytest.approx(space.step_tokens, rel=0.08)
    p, screen = s.placement, Screen(space)
    _, t_thr, prefill = screen._full_occupancy(p, screen.ceiling_batch(p))
    sync = screen.weight_sync(p)
    assert not p.colocated
    bound = max(t_thr + prefill, p.train.step_s + sync.gather_s + sync.convert_s, screen.tail_bound(p))
    assert screen.overlap_ceiling(p) * bound == pytest.approx(space.step_tokens)


def test_consolidation_batch_is_the_batching_knee_unless_pinned() -> None:
    from planner.rollout_cost import make_rollout_cost_model
    from planner.search.core import Space

    streaming = SMALL_GPU.replace("staleness: {max_version_lag: 2}", "staleness: {max_version_lag: 2, mode: streaming}")
    streaming += "placement:\n  colocated: false\n"
    resolved = _resolved(streaming)
    plan = make_plan(resolved).plan
    knee = plan.rollout.consolidation_batch
    # the knee at a tail's context (E[L^2]/E[L] = 2.4K tokens here, twice the slots' mean context): below every slot,
    # and below what the KV cache holds of such tails
    inputs = search_inputs(resolved)
    space = Space(inputs)
    assert space.ctx_tail - space.prompt_mean == pytest.approx(2 * (space.ctx_avg - space.prompt_mean))
    model = make_rollout_cost_model(inputs.arch, inputs.accelerator, tp=plan.rollout.tp, dtype_bytes=inputs.dtype_bytes,
                                    calib=inputs.calibration,
                                    accelerators_per_node=inputs.accelerators_per_node)
    assert plan.mode == "streaming" and knee == model.batching_knee(space.ctx_tail, 256) == 132
    assert knee < plan.rollout.max_num_seqs == 256 and knee < plan.rollout.kv_capacity_tokens // space.ctx_tail
    # dense-32b's tp4 engines: 43 tails of 9.4K tokens (the knee at the mean context, 5.2K, was 79, where the tails
    # took up to 2.2x the KV cache); the KV cache would hold 93 of them
    dense = search_inputs(load_spec(str(SPECS / "dense-32b-h800x128.yaml")))
    space = Space(dense)
    tp4 = next(o for o in space.rollout_options if o.tp == 4)
    model = make_rollout_cost_model(dense.arch, dense.accelerator, tp=4, dtype_bytes=dense.dtype_bytes,
                                    calib=dense.calibration, accelerators_per_node=dense.accelerators_per_node)
    assert tp4.consolidation_batch == model.batching_knee(space.ctx_tail, 256) == 43
    assert model.batching_knee(space.ctx_avg, 256) == 79 and tp4.memory.kv_capacity_tokens // space.ctx_tail == 93
    pinned = make_plan(_resolved(streaming + "  rollout: {consolidation_batch: 7}\n")).plan
    assert pinned.rollout.consolidation_batch == 7
    full = make_plan(_resolved(streaming + "  rollout: {consolidation_batch: 100000}\n")).plan
    assert full.rollout.consolidation_batch == full.rollout.max_num_seqs  # packs engines full
    sync = make_plan(_resolved(SMALL_GPU.replace("staleness: {max_version_lag: 2}",
                                                 "staleness: {max_version_lag: 2, mode: sync}"))).plan
    assert sync.rollout.consolidation_batch is None


def test_a_max_num_seqs_pin_caps_every_engines_slots_and_the_kv_cache_still_bounds_them() -> None:
    spec = SMALL_GPU + "placement:\n  rollout: {max_num_seqs: 24}\n"
    plan = make_plan(_resolved(spec)).plan
    assert plan.rollout.max_num_seqs == 24
    assert search_inputs(_resolved(spec)).max_num_seqs_cap == 24
    assert search_inputs(_resolved(spec), unpinned=True).max_num_seqs_cap == 256  # the pins' cost is measured without
    # above what the KV cache holds at the mean context, the cache decides (vLLM would preempt the excess)
    big = make_plan(_resolved(SMALL_GPU + "placement:\n  rollout: {max_num_seqs: 5000}\n")).plan
    assert big.rollout.max_num_seqs < 5000
    assert big.rollout.max_num_seqs == int(big.rollout.kv_capacity_tokens // _mean_context(_resolved(SMALL_GPU)))
    # vLLM's profiling run samples over max_num_seqs rows of logits first: 100,000 leave no room on any layout
    with pytest.raises(InfeasibleError, match=r"or max_num_seqs \(100000: the reserve holds a sampler pass"):
        make_plan(_resolved(SMALL_GPU + "placement:\n  rollout: {max_num_seqs: 100000}\n"))


def _mean_context(resolved) -> float:
    from planner.search.core import Space

    return Space(search_inputs(resolved)).ctx_avg


def test_local_task_lengths_are_per_prompt_and_shorten_the_expected_tail() -> None:
    import dataclasses

    from planner.search.core import Space
    from planner.search.screen import Screen

    local = search_inputs(load_spec(str(SPECS / "local-tiny.yaml")))
    assert local.lengths_per_prompt  # the count task's prompt fixes its answer's length
    assert not search_inputs(load_spec(str(SPECS / "dense-32b-h800x128.yaml"))).lengths_per_prompt
    per_sample = dataclasses.replace(local, lengths_per_prompt=False)
    dist, spp = local.response_lengths, local.samples_per_prompt
    # the batch's longest response is the largest of prompts_per_step draws, not of prompts x samples
    n = local.prompts_per_step
    assert Screen(Space(local)).expected_max_response() == float(dist.quantile(1 - 1 / (n + 1)))
    assert Screen(Space(per_sample)).expected_max_response() == float(dist.quantile(1 - 1 / (n * spp + 1)))
    assert Space(local).longest_seq_tokens < Space(per_sample).longest_seq_tokens


def test_cpu_rollout_engines_are_one_core_each_and_a_pinned_tp_is_refused_with_the_reason():
    # The runtime runs each CPU engine on one thread (two threads decode local-tiny 2x slower): a plan that priced
    # a 2-core engine as tensor parallel predicted a rollout the run never had.
    import dataclasses

    from planner.search import Pins

    inputs = search_inputs(_tiny_auto())
    outcome = search(inputs)
    assert {c.placement.rollout.tp for c in outcome.screened} == {1}
    assert any(c.placement.colocated and c.placement.replicas == 2 for c in outcome.screened if c.mode == "sync")
    with pytest.raises(InfeasibleError) as info:
        search(dataclasses.replace(inputs, pins=Pins(rollout_tp=2)))
    assert info.value.closest is not None and "one thread per replica" in info.value.closest.reason


def test_a_tail_stall_is_reported_with_what_one_more_version_of_staleness_simulates_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning's figure is a simulation of the chosen placement and mode at k + 1: beyond the budget a what-if
    (dense-8b, k=2: the trainer waits on the tail and k=3 trains more), within it a candidate like any other
    (k=4 simulated, not chosen, the rollout side limits the plan). Both where the trainer cannot start a step early
    (several optimizer steps per step, or colocated: ``early_steps_for``), as here by patching; where it can, the
    dense-8b plan's trainer no longer waits on the tail (``test_early_steps_hide_the_tail_stall``)."""
    import planner.search.build as build
    import planner.search.core as core
    import planner.search.screen as screen

    for module in (core, build, screen):
        monkeypatch.setattr(module, "early_steps_for", lambda mode, colocated, optimizer_steps: False)
    planned = make_plan(load_spec(str(SPECS / "dense-8b-h800x64.yaml")))
    outcome = planned.outcome
    chosen, alt = outcome.chosen, outcome.one_more_version
    assert chosen.screened.k == 2 and alt is not None
    assert alt.screened.k == 3 and alt.screened.placement == chosen.screened.placement
    assert alt.sim_steps == chosen.sim_steps and alt not in outcome.finalists  # a what-if, not a candidate
    gain = alt.trained_tokens_per_s / chosen.trained_tokens_per_s - 1
    assert gain > 0.02
    (warning,) = [w for w in planned.plan.warnings if "oldest version's tail" in w]
    assert f"at k=2: raising staleness.max_version_lag to 3 trains {100 * gain:.0f}% more tokens/s" in warning

    # within the budget: local-tiny with a budget of 4 plans k=3, whose trainer waits 7% of a step on the tail, under
    # the 10% that triggers the check; at a threshold of 0, k=4 is simulated as a candidate, ties, and the tie goes
    # to the lower k
    monkeypatch.setattr(core, "STALL_FRACTION", 0.0)
    monkeypatch.setattr(build, "STALL_FRACTION", 0.0)
    tiny = _resolved((SPECS / "local-tiny.yaml").read_text(), **{"max_version_lag: 3": "max_version_lag: 4"})
    planned = make_plan(tiny)
    outcome = planned.outcome
    assert outcome.chosen.screened.k == 3 and outcome.one_more_version is None
    (k4,) = [s for s in outcome.finalists if s.screened.placement == outcome.chosen.screened.placement
             and s.screened.mode == "streaming" and s.screened.k == 4 and s.sim_steps == outcome.chosen.sim_steps]
    gain = k4.trained_tokens_per_s / outcome.chosen.trained_tokens_per_s - 1
    assert gain < 0.01  # a tie at most, which goes to the lower k
    (warning,) = [w for w in planned.plan.warnings if "oldest version's tail" in w]
    assert f"but k=4 changes trained tokens/s by only {100 * gain:+.1f}% (simulated): the rollout side" in warning


def test_early_steps_hide_the_tail_stall() -> None:
    """dense-8b's disaggregated plan at k=2, whose trainer waits on the oldest version's tail when every step waits
    for its whole batch, starts those steps early: no tail-stall warning, and more trained tokens/s than the same
    placement without early steps."""
    planned = make_plan(load_spec(str(SPECS / "dense-8b-h800x64.yaml")))
    chosen = planned.outcome.chosen
    assert planned.plan.early_steps and not chosen.screened.placement.colocated and chosen.screened.k == 2
    assert planned.outcome.one_more_version is None
    assert not [w for w in planned.plan.warnings if "oldest version's tail" in w]
    inputs = search_inputs(load_spec(str(SPECS / "dense-8b-h800x64.yaml")))
    waits = simulate_candidate(Space(dataclasses.replace(inputs, early_steps=False)), chosen.screened,
                               steps=chosen.sim_steps)
    assert chosen.sim.tokens_per_s > 1.1 * waits.tokens_per_s
    assert sum(s.trainer_wait_s for s in chosen.sim.steps[1:]) < sum(s.trainer_wait_s for s in waits.steps[1:])


def test_fp8_quantizes_the_rollout_weights_only() -> None:
    """``model.dtype: fp8`` lowers to vLLM's fp8 weights with bf16 activations and KV cache, and a bf16 trainer: the
    planner prices one byte per rollout weight and two for the KV cache, activations, messages and training."""
    from planner.rollout_cost import rollout_instance_memory

    bf16 = search_inputs(_resolved(SMALL_GPU))
    fp8 = search_inputs(_resolved(SMALL_GPU, **{"model: {": "model: {dtype: fp8, "}))
    assert (fp8.dtype_bytes, fp8.rollout_weight_bytes) == (2, 1)
    assert (bf16.dtype_bytes, bf16.rollout_weight_bytes) == (2, 2)
    memory = {inp.rollout_weight_bytes: rollout_instance_memory(
        inp.arch, inp.accelerator, tp=1, dtype_bytes=inp.dtype_bytes, weight_dtype_bytes=inp.rollout_weight_bytes,
        max_num_seqs=inp.max_num_seqs_cap) for inp in (bf16, fp8)}
    assert memory[1].weights_bytes_per_device == pytest.approx(memory[2].weights_bytes_per_device / 2)
    freed = memory[2].weights_bytes_per_device / 2
    assert memory[1].kv_bytes_per_device == pytest.approx(memory[2].kv_bytes_per_device + freed)
    per_token = memory[2].kv_bytes_per_device / memory[2].kv_capacity_tokens  # bf16 KV, both
    assert memory[1].kv_capacity_tokens == pytest.approx(memory[1].kv_bytes_per_device / per_token, abs=1)


def test_a_train_accelerators_pin_below_the_cluster_means_disaggregated() -> None:
    """Colocated plans train on every accelerator: a pinned smaller trainer rules them out (it used to be ignored by
    the colocated candidates, which then won)."""
    plan = make_plan(_resolved(SMALL_GPU + "placement:\n  train: {accelerators: 8}\n")).plan
    assert not plan.colocated and plan.train.accelerators == 8


def test_objective_time_ranks_by_the_time_to_finish_every_step() -> None:
    """With few steps the first one, while the pipeline fills, weighs: `time` (and `cost`, which follows it) picks the
    finalist that finishes the run first, `throughput` the best steady state."""
    from planner.search.core import objective_rate

    few = SMALL_GPU.replace("steps: 20", "steps: 3").replace("accelerators_per_node: 8}",
                                                             "accelerators_per_node: 8, price_per_accelerator_hour_usd: 2}")
    for objective in ("time", "cost", "throughput"):
        inputs = search_inputs(_resolved(few + f"objective: {objective}\n"))
        outcome = search(inputs)
        rates = {s.screened.label: objective_rate(s, inputs) for s in outcome.finalists}
        assert objective_rate(outcome.chosen, inputs) >= max(rates.values()) * (1 - 0.01)
        total = {s.screened.label: s.sim.steps[0].duration_s + 2 * s.sim.step_time_s for s in outcome.finalists}
        if objective != "throughput":
            assert total[outcome.chosen.screened.label] <= min(total.values()) * 1.01
        else:
            assert rates[outcome.chosen.screened.label] == outcome.chosen.trained_tokens_per_s


def test_the_chosen_plan_and_the_baseline_are_simulated_on_the_whole_cluster() -> None:
    """A large batch is ranked on reduced-scale simulations, which run fast (fewer replicas, fewer of the longest
    responses): the chosen plan, the sync baseline and every run within WHOLE_MARGIN of either are then simulated on
    the whole cluster and batch, and the plan's figures, the KV cache's included, are those."""
    from planner.search.core import WHOLE_MARGIN

    big = _resolved(SMALL_GPU.replace("prompts_per_step: 32", "prompts_per_step: 512"))
    result = make_plan(big)
    outcome, preds = result.outcome, result.plan.predictions
    assert any(s.scale > 1 for s in outcome.finalists)  # the search ranked at a reduced scale
    assert outcome.chosen.scale == 1 and outcome.best_sync is not None and outcome.best_sync.scale == 1
    whole = outcome.chosen.sim
    assert sum(s.num_samples for s in whole.steps) == len(whole.steps) * big.spec.workload.prompts_per_step * 8
    best = outcome.chosen.trained_tokens_per_s
    assert all(s.scale == 1 for s in outcome.finalists if s.trained_tokens_per_s >= best * (1 - WHOLE_MARGIN))
    assert preds.trained_tokens_per_s == best
    n = len(whole.steps)
    assert (preds.kv_preemptions_per_step, preds.kv_recomputes_per_step, preds.kv_recomputed_tokens_per_step) == (
        whole.preemptions / n, whole.recomputed_sequences / n, whole.recomputed_tokens / n)


def test_a_trainer_or_rollout_pool_smaller_than_a_node_is_searched_on_a_multi_node_cluster() -> None:
    """verl's one-step-off recipe splits two nodes of 8 GPUs into 4 rollout + 12 training. Whole-node splits alone
    left 8 + 8 on two nodes, which the cost model puts 28% below the source's split for that workload."""
    from planner.search.core import Space

    paper = load_spec(str(REPO / "bench" / "papers" / "verl-one-step-off-qwen2.5-7b-h20x16.yaml"))
    space = Space(search_inputs(paper))
    assert space.train_sizes(1) == list(range(1, 16)) and space.train_sizes(4) == [4, 8, 12]
    plan = make_plan(paper).plan
    assert (plan.colocated, plan.rollout.accelerators, plan.train.accelerators) == (False, 4, 12)
    big = Space(search_inputs(load_spec(str(SPECS / "dense-32b-h800x128.yaml"))))
    sizes = big.train_sizes(4)
    assert {4, 124} <= set(sizes) and all(t % 8 == 0 for t in sizes if 8 <= t <= 120)


def test_a_large_staleness_budget_is_searched_on_a_ladder_of_k() -> None:
    """dense-8b with a budget of 64 and version mixing simulated 192 (mode, k) of its leading placement, 67 steps
    each (55 s); every k up to 8 is still searched, then 12, 16, 24, ... and the budget."""
    from planner.search.core import mode_ks, staleness_ladder

    assert staleness_ladder(3) == [1, 2, 3] and staleness_ladder(8) == list(range(1, 9))
    assert staleness_ladder(13) == [*range(1, 9), 12, 13]
    assert staleness_ladder(64) == [*range(1, 9), 12, 16, 24, 32, 48, 64]
    inputs = search_inputs(_resolved(SMALL_GPU, **{"{max_version_lag: 2}": "{max_version_lag: 64}"}))
    ks = {m: sorted(k for mm, k in mode_ks(inputs, colocated=False) if mm == m) for m, _ in mode_ks(inputs, False)}
    assert ks["streaming"] == ks["bounded-async"] == staleness_ladder(64) and ks["one-step-off"] == [1]
    assert ks["sync"] == [0]


def test_rollout_tp_gives_vllm_whole_kv_heads() -> None:
    """48 query heads over 6 KV heads: tp 4 divides the heads but not the KV heads (nor do they divide it), a QKV
    split vLLM does not build; the search chose it (a fuzzing pass). Every rollout option now holds whole KV heads
    per rank or replicates each over whole ranks."""
    import dataclasses

    from planner.search.space import Space

    inputs = search_inputs(load_spec(str(SPECS / "dense-8b-h800x64.yaml")))
    arch = dataclasses.replace(inputs.arch, num_attention_heads=48, num_kv_heads=6, hidden_size=6144, head_dim=128)
    tps = {o.tp for o in Space(dataclasses.replace(inputs, arch=arch)).rollout_options}
    assert tps == {1, 2}  # the powers of two dividing 48 that hold 6 KV heads whole: not 4, 8 or 16
    assert not arch.tp_shards_kv_heads(4) and arch.tp_shards_kv_heads(2) and arch.tp_shards_kv_heads(12)


def test_moe_rollout_engines_may_run_attention_data_parallel_and_a_spec_pins_them_as_tp_with_ep() -> None:
    """Qwen3-235B's 4 KV heads are copied onto every rank of a tp16 engine; attention data-parallel ranks of 4 devices
    (a KV head each) keep one sequence's KV on one rank and read a quarter of its non-expert weights per device. The
    search finds 32 such ranks for the 235B example (128 devices: one expert each), a spec pins them as tp with
    ep = tp x ranks (tp 1 with ep 16: 16 ranks of one device), and a pinned tp 16 leaves them out."""
    text = (SPECS / "moe-235b-h800x512.yaml").read_text()
    free = example_planned("moe-235b-h800x512").plan
    assert (free.rollout.tp, free.rollout.ep, free.rollout.accelerators_per_replica) == (4, 128, 128)
    assert free.rollout.attention_dp == 32
    assert free.rollout.max_num_seqs > 256  # over 32 ranks, each with vLLM's 256 (less where the KV cache holds less)
    one_device_ranks = make_plan(_resolved(text + "placement:\n  rollout: {tp: 1, ep: 32}\n")).plan
    assert (one_device_ranks.rollout.tp, one_device_ranks.rollout.attention_dp) == (1, 32)
    assert free.predictions.trained_tokens_per_s > one_device_ranks.predictions.trained_tokens_per_s
    resolved = _resolved(text + "placement:\n  colocated: false\n  rollout: {tp: 1, ep: 16, max_num_seqs: 16}\n")
    pinned = make_plan(resolved).plan
    assert (pinned.rollout.tp, pinned.rollout.ep, pinned.rollout.accelerators_per_replica) == (1, 16, 16)
    # max_num_seqs is vLLM's, one rank's: 16 ranks of 16; a saved plan of it is not read as breaking its pin
    from dora.apply import _outside_spec

    assert pinned.rollout.max_num_seqs == 16 * 16 and _outside_spec(pinned, resolved.spec) == []
    tp16 = make_plan(_resolved(text + "placement:\n  rollout: {tp: 16}\n")).plan
    assert tp16.rollout.accelerators_per_replica == 16 and tp16.rollout.tp == 16
    assert free.predictions.trained_tokens_per_s > tp16.predictions.trained_tokens_per_s


def test_host_memory_parks_the_larger_side_of_a_colocated_placement() -> None:
    """While the engines roll out the trainer's state waits in host memory; while it trains, the engines' weights (and
    in streaming their KV cache): the larger of the two, plus the reserve, against the node's memory per accelerator."""
    from planner.search.core import Space, _placements
    from planner.search.screen import HOST_MEMORY_RESERVED_SHARE, Screen, host_memory, train_state_bytes

    inputs = search_inputs(load_spec(str(SPECS / "dense-32b-h800x128.yaml")))
    space = Space(inputs)
    placements = _placements(space, Screen(space))
    share = 2048 * 1024**3 / 8
    reserve = HOST_MEMORY_RESERVED_SHARE * share
    seen = 0
    for p in placements:
        for mode in ("sync", "streaming"):
            host = host_memory(p, mode, inputs)
            if not p.colocated:
                assert host is None
                continue
            m = p.rollout.memory
            engine = m.weights_bytes_per_device + m.extra_version_bytes_per_device
            engine += m.kv_bytes_per_device if mode == "streaming" else 0.0
            assert host is not None and host.have_bytes == share
            assert host.need_bytes == pytest.approx(max(engine, train_state_bytes(p)) + reserve)
            assert sum(host.detail.values()) == pytest.approx(host.need_bytes)
            seen += 1
    assert seen >= 4
    # the local engines' memory is the host's: nothing is parked
    local = search_inputs(load_spec(str(SPECS / "local-tiny.yaml")))
    assert all(host_memory(p, "streaming", local) is None for p in _placements(Space(local), Screen(Space(local))))


def test_the_simulation_of_an_attention_dp_engine_tracks_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate's engines of dp attention data-parallel ranks are simulated as dp ranks (each with 1/dp of the
    slots and of the KV cache, ``planner.sim.simulator``), an engine of one rank as one."""
    import planner.search.core as core
    from planner.search.screen import Screen

    inputs = search_inputs(load_spec(str(SPECS / "moe-235b-h800x512.yaml")))
    space = core.Space(inputs)
    placements = core._placements(space, Screen(space))
    seen: list[int] = []
    real = core.simulate

    def spy(*args, **kwargs):
        seen.append(kwargs["attention_dp"])
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "simulate", spy)
    screen = Screen(space)
    for dp in (8, 1):
        p = next(p for p in placements if p.rollout.dp == dp and not p.colocated)
        core.simulate_candidate(space, screen.evaluate(p, "sync", 0), steps=1,
                                scale=core.scale_for(inputs, p.replicas, 1, budget=2_000))
    assert seen == [8, 1]


def test_a_reduced_scale_simulation_keeps_two_replicas_and_the_batch_per_replica() -> None:
    """Scaling a plan of few replicas down to one changed its dynamics: the 235B example's sync plan, 4 replicas run
    as 1, simulated 18% faster than on the whole cluster. A reduced-scale run keeps at least MIN_SCALED_REPLICAS, and
    the prompts per replica of the whole cluster."""
    from planner.search.core import MIN_SCALED_REPLICAS, Scaled, scale_for

    inputs = search_inputs(load_spec(str(SPECS / "moe-235b-h800x512.yaml")))
    assert MIN_SCALED_REPLICAS == 2
    assert scale_for(inputs, 4, 24, max_factor=8.0) == Scaled(replicas=2, prompts_per_step=256, factor=2.0)
    assert scale_for(inputs, 2, 24, max_factor=8.0).factor == 1.0  # nothing to scale down to
    assert scale_for(inputs, 1, 24, max_factor=8.0).factor == 1.0
    big = scale_for(inputs, 64, 24, max_factor=8.0)  # far from the floor: 8,192 x 24 samples over the budget, 1/3.28
    assert (big.replicas, big.prompts_per_step, big.factor) == (20, 160, 3.2)


def test_a_cpu_plans_kv_cache_is_what_the_torch_engine_allocates() -> None:
    """dora's CPU engine preallocates every slot at the whole context (KVCache), not vLLM's pool of pages over what the
    weights leave: the memory table printed 6.95 GiB of KV cache for local-tiny, whose engines allocate 5.4 MB."""
    from dora.planning import make_plan
    from dora.runtime.engines.tiny_model import KVCache, TinyModelConfig

    resolved = load_spec(str(SPECS / "local-tiny.yaml"))
    plan = make_plan(resolved).plan
    a = search_inputs(resolved).arch
    cache = KVCache(TinyModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_heads=a.num_attention_heads,
                                    num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, ffn_size=a.ffn_hidden_size,
                                    vocab_size=a.vocab_size),
                    num_slots=plan.rollout.max_num_seqs, max_len=plan.rollout.max_model_len)
    allocated = sum(t.numel() * t.element_size() for t in (cache.k, cache.v))
    rollout = next(m for m in plan.memory if m.side == "rollout")
    assert rollout.detail["kv_cache"] == allocated == 5_406_720
    assert plan.rollout.kv_capacity_tokens == plan.rollout.max_num_seqs * plan.rollout.max_model_len
    assert rollout.need_bytes == sum(v for k, v in rollout.detail.items())  # weights, versions, cache and reserve
