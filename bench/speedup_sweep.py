"""What the speedup of streaming over synchronous training depends on, one knob at a time.

Asynchronous modes win the time a synchronous step waits for its longest trajectories. That wait is about fixed (the
longest response decoded nearly alone), while the rest of the step's work shrinks as the cluster grows, so the win
depends on the cluster size, on the response-length tail, on how fast an engine decodes a lone sequence (the fixed
per-step cost, ``Calibration.decode_step_overhead_s``) against a full batch (what each sequence adds to a step), and on
the staleness budget k (the trainer may not run ahead of the oldest tail by more than k versions). This replans one spec (default: the dense 32B example), restricted to sync
and streaming, varying one knob at a time from the spec's values, and prints the best sync plan, the chosen streaming
plan, their ratio, the overlap ceiling over the best sync (``SearchOutcome.overlap_ceiling``: a perfect schedule on
the best placement, every slot busy up to the staleness budget, training overlapped with rollout or, colocated, in turn
with it, and the longest response trained within k + 1 steps of its version) and the streaming plan's simulated slot
occupancy. The k sweep runs at the largest cluster size of the first sweep.

Rows other than the spec's own are what-ifs, not claims about the example.

    python bench/speedup_sweep.py [--spec dense-32b-h800x128] [--nodes 8 16 32 64] [--p99 12000 24000 48000 96000]
                                  [--overhead-ms 2 6] [--per-sequence-us 0 100] [--k 1 3 5 8]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from dora.planning import search_inputs
from dora.spec import load_spec
from planner.rollout_cost import RolloutCostModel
from planner.search import search
from planner.search.inputs import SearchInputs
from planner.workload import LengthDistribution

REPO = Path(__file__).resolve().parent.parent


def _row(knob: str, inputs: SearchInputs, is_spec: bool) -> None:
    t0 = time.perf_counter()
    outcome = search(inputs)
    sync, stream = outcome.best_sync, outcome.chosen
    if sync is None or stream.screened.mode != "streaming":
        print(f"  {knob:22} no sync/streaming pair (chosen: {stream.screened.label})")
        return
    s_rate, x_rate = sync.trained_tokens_per_s, stream.trained_tokens_per_s
    ceiling = outcome.overlap_ceiling[0] / s_rate if outcome.overlap_ceiling else float("nan")
    mark = "  <- the spec" if is_spec else ""
    print(f"  {knob:22} {s_rate:10,.0f} {x_rate:10,.0f} {x_rate / s_rate:6.2f}x {ceiling:7.2f}x "
          f"{100 * stream.sim.rollout_slot_occupancy:5.0f}% {time.perf_counter() - t0:4.1f}s  "
          f"{sync.screened.placement.label} / {stream.screened.placement.label}{mark}")


@contextlib.contextmanager
def _per_sequence_cost(seconds: float) -> Iterator[None]:
    """A what-if the cost model has no constant for: every decode step of a batch of B sequences takes B *
    ``seconds`` longer, as an engine whose scheduling and sampling cost grows with the batch (a prefill, one prompt,
    ``seconds`` once). Added to ``RolloutCostModel._comm_s``, the batch-dependent term of a step that both the screen
    and the simulator read; ``prefill_s`` passes it a token count, so it takes the per-token part back out."""
    comm_s, prefill_s = RolloutCostModel._comm_s, RolloutCostModel.prefill_s

    def prefill(self: RolloutCostModel, num_tokens: int, sum_sq_tokens: float | None = None) -> float:
        return prefill_s(self, num_tokens, sum_sq_tokens) - seconds * (num_tokens - 1)

    with mock.patch.object(RolloutCostModel, "_comm_s",
                           lambda self, b, share=1.0: comm_s(self, b, share) + seconds * b), \
            mock.patch.object(RolloutCostModel, "prefill_s", prefill):
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="dense-32b-h800x128")
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64], help="cluster nodes")
    ap.add_argument("--p99", type=int, nargs="+", default=[12000, 24000, 48000, 96000],
                    help="response p99 tokens before the cap (the spec's median and cap are kept)")
    ap.add_argument("--overhead-ms", type=float, nargs="+", default=[2.0, 6.0],
                    help="fixed cost of one engine decode step, ms (catalog prior: 2)")
    ap.add_argument("--per-sequence-us", type=float, nargs="+", default=[0, 100],
                    help="extra decode step time per sequence in the batch, us (the cost model has none; vLLM "
                         "~0.5-0.6's fixed-batch runs in costmodel_vs_published.py leave 70-120 us unexplained)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3, 5, 8], help="staleness budgets")
    args = ap.parse_args()
    spec = load_spec(str(REPO / "specs" / f"{args.spec}.yaml"))
    base = search_inputs(spec)
    base = dataclasses.replace(base, modes=tuple(m for m in base.modes if m in ("sync", "streaming")))
    dist = base.response_lengths
    if dist.kind != "lognormal":
        ap.error(f"{args.spec}: the tail sweep needs a lognormal response length")
    spec_p99 = dist.quantile(0.99)
    prior_ms = base.calibration.decode_step_overhead_s * 1e3
    n_acc = base.accelerators_per_node
    print(f"{args.spec}: {base.total_accelerators} x {base.accelerator.name}, {base.prompts_per_step}x"
          f"{base.samples_per_prompt} per step, response median {dist.median_tokens:,.0f} / p99 {spec_p99:,} / cap "
          f"{dist.max_tokens:,} tokens, decode step overhead {prior_ms:g} ms, k={base.max_version_lag}")
    print(f"  {'knob':22} {'sync tok/s':>10} {'streaming':>10} {'x sync':>7} {'ceiling':>8} {'occ.':>6} {'plan':>5}  "
          "best sync plan / streaming plan")
    for nodes in args.nodes:
        _row(f"{nodes * n_acc} accelerators", dataclasses.replace(base, nodes=nodes), nodes == base.nodes)
    for p99 in args.p99:
        lengths = LengthDistribution.lognormal(median=dist.median_tokens, p99=p99, max_tokens=dist.max_tokens,
                                               min_tokens=dist.min_tokens)
        at_cap = (1.0 - statistics.NormalDist().cdf(math.log(dist.max_tokens / dist.median_tokens) / lengths.sigma)
                  if lengths.sigma else float(dist.median_tokens > dist.max_tokens))
        _row(f"p99 {p99:,} ({100 * at_cap:.1f}% cut)", dataclasses.replace(base, response_lengths=lengths),
             p99 == spec_p99)
    for ms in args.overhead_ms:
        calib = dataclasses.replace(base.calibration, decode_step_overhead_s=ms / 1e3)
        _row(f"step overhead {ms:g} ms", dataclasses.replace(base, calibration=calib), math.isclose(ms, prior_ms))
    for us in args.per_sequence_us:
        with _per_sequence_cost(us * 1e-6):
            _row(f"+{us:g} us per sequence", base, us == 0)
    big = max(args.nodes)
    for k in args.k:
        _row(f"k={k} on {big * n_acc}", dataclasses.replace(base, nodes=big, max_version_lag=k),
             big == base.nodes and k == base.max_version_lag)


if __name__ == "__main__":
    main()
