"""What a person watching ``dora apply`` sees: a live panel while it runs, and a summary at the end.

The live panel shows step / total, reward (last step and a sparkline of every step), live versions
and what each rollout worker serves, staleness, generated and trained tokens per second, rollout
slot occupancy and an ETA extrapolated from the steady-state step time. Before the first step it says what the
run is doing (starting the actors, the warm-up, loading the first weights). It only reads ``RunStats`` and those
phase messages; refreshes are throttled by ``rich.live.Live``.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dora.runtime.trace import SPEED_PREFIXES, RunStats, speed_key

_BARS = "▁▂▃▄▅▆▇█"


def share(fraction: float) -> str:
    """A fraction as a percentage with two decimals, or to one significant digit where those would print a non-zero
    share as 0.00% (a TIS cap that truncated 5 tokens in 100,000: 0.005%, beside an IS weight max above the cap)."""
    text = f"{fraction:.2%}"
    if fraction <= 0 or float(text[:-1]) != 0:
        return text
    return f"{100 * fraction:.1g}%" if 100 * fraction >= 1e-3 else "<0.001%"


def sparkline(values: list[float], *, low: float = 0.0, high: float = 1.0, width: int = 40) -> str:
    """The whole series in at most ``width`` characters, scaled between ``low`` and ``high``: one per value, or, for a
    longer series, one per run of consecutive values (their mean; the runs' lengths differ by at most one)."""
    n = len(values)
    if n > width:
        bounds = [i * n // width for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(bounds, bounds[1:], strict=False)]
    span = max(high - low, 1e-9)
    return "".join(_BARS[min(len(_BARS) - 1, max(0, int((v - low) / span * len(_BARS))))] for v in values)


def _eta_s(stats: RunStats) -> float | None:
    s = stats.steps
    if len(s) < 2:
        return None
    per_step = (s[-1].end_s - s[0].end_s) / (len(s) - 1)
    return per_step * (stats.total_steps - s[-1].step)


def render(stats: RunStats, title: str) -> Panel:
    """The live panel for the current state of the run."""
    s = stats.steps
    last = s[-1] if s else None
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    done = s[-1].step if s else (stats.resumed_from_step or 0)
    table.add_row("step", f"{done} / {stats.total_steps}   t={stats.now_s:6.1f}s"
                  + (f"   (resumed after step {stats.resumed_from_step})" if stats.resumed_from_step else ""))
    if last is not None:
        rewards = [r.reward_mean for r in s]
        table.add_row("reward", f"{last.reward_mean:.3f} (exact {last.exact_fraction:.0%})  {sparkline(rewards)}")
        table.add_row("staleness", f"mean {last.mean_staleness:.2f}  max {last.max_staleness}   "
                                   f"IS weight mean {last.is_weight_mean:.3f} max {last.is_weight_max:.2f} "
                                   f"clipped {share(last.is_weight_clip_frac)}")
        table.add_row("throughput", f"generated {last.generated_tokens / last.step_time_s:7.0f} tok/s   "
                                    f"trained {last.forward_tokens / last.step_time_s:7.0f} tok/s   "
                                    f"step {last.step_time_s:.2f}s (rollout under way {last.rollout_share:.0%} of it)")
    versions = ", ".join(f"v{v}" for v in stats.live_versions)
    engines = " ".join(f"v{v}" for v in stats.engine_versions)
    table.add_row("versions", f"live {versions}   workers serve {engines}")
    occ = f"now {stats.occupancy_now:.0%}"
    if last is not None:
        occ += f"   last step {last.rollout_occupancy:.0%}"
    table.add_row("rollout slots", f"{occ}   in flight {stats.in_flight}/{stats.num_workers * stats.slots_per_worker}")
    eta = _eta_s(stats)
    table.add_row("eta", "estimating..." if eta is None else f"{eta:5.0f}s")
    return Panel(table, title=title, border_style="cyan")


class LiveDisplay:
    """A ``rich.live.Live`` around the run; ``update`` is the controller's progress callback."""

    def __init__(self, console: Console, title: str, *, enabled: bool = True) -> None:
        self.console = console
        self.title = title
        self.enabled = enabled and console.is_terminal
        self._live: Live | None = None
        self._printed_steps = 0

    def __enter__(self) -> LiveDisplay:
        if self.enabled:
            self._live = Live(console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def phase(self, what: str) -> None:
        """What the run does before its first step: the panel's only line until then, or one plain line."""
        if self._live is not None:
            self._live.update(Panel(Text(what), title=self.title, border_style="cyan"))
        else:
            self.console.print(what, markup=False, highlight=False)

    def update(self, stats: RunStats) -> None:
        if self._live is not None:
            self._live.update(render(stats, self.title))
            return
        # Not a terminal (CI, a pipe): one plain line per finished step instead of a live panel.
        for r in stats.steps[self._printed_steps:]:
            self.console.print(
                f"step {r.step:3d}/{stats.total_steps}  reward {r.reward_mean:.3f}  staleness {r.mean_staleness:.2f}  "
                f"step {r.step_time_s:.2f}s  occupancy {r.rollout_occupancy:.0%}  "
                f"trained {r.forward_tokens / r.step_time_s:.0f} tok/s", markup=False, highlight=False,
            )
        self._printed_steps = len(stats.steps)


def render_summary(summary: dict[str, Any], audit: dict[str, Any]) -> Group:
    """The final summary: throughput, occupancy, staleness, reward, IS weights, audit verdict.

    Speed figures are labelled with what they cover: this attempt's steady state, or, for an attempt of one step, that
    step with the pipeline filling up (``dora.runtime.trace.SPEED_PREFIXES``); a run only audited again has none."""
    resumed = summary.get("resumed_from_step")
    again = bool(summary.get("audited_again"))
    if again:
        took = ", audited again (no step ran now: no speed figures)"
    elif resumed is None:
        took = f" in {summary['wall_s']:.1f}s"
    else:
        took = f" ({summary['wall_s']:.1f}s after resuming at step {resumed})"
    t = Table(title=f"dora apply — {summary['mode']}: {summary['steps']}/{summary['total_steps']} steps{took}",
              show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    # a resumed run's speed is this attempt's; its counts and what it trained on cover every step
    attempt = " since resume" if resumed is not None and not again else ""
    for prefix in SPEED_PREFIXES:
        if speed_key(prefix, "trained_tokens_per_s") not in summary:
            continue
        what = f"steady{attempt}" if prefix == "steady" else f"first step{attempt}"
        if prefix == "first_step":
            t.add_row("speed", "one step, no steady state: these figures include the pipeline fill")
        t.add_row(f"trained tokens/s ({what})", f"{summary[speed_key(prefix, 'trained_tokens_per_s')]:.0f}")
        t.add_row(f"generated tokens/s ({what})", f"{summary[speed_key(prefix, 'generated_tokens_per_s')]:.0f}")
        t.add_row(f"step time ({what})", f"{summary[speed_key(prefix, 'step_time_s')]:.2f}s, rollout under way "
                                         f"{summary[speed_key(prefix, 'rollout_share')]:.0%} of it")
        t.add_row("rollout slot occupancy" + (attempt if prefix == "steady" else f" ({what})"),
                  f"{summary[speed_key(prefix, 'rollout_occupancy')]:.0%}")
    if "mean_staleness" in summary:
        live = (f", live versions up to {summary['max_live_versions']}" if "max_live_versions" in summary else "")
        t.add_row("staleness", f"mean {summary['mean_staleness']:.2f}, max {summary['max_staleness']}{live}")
        t.add_row("trained response length", f"{summary['mean_trained_response_tokens']:.1f} tokens (mean)")
        t.add_row("reward", f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}  "
                            f"{sparkline(summary['reward_curve'])}")
        t.add_row("IS weights", f"mean {summary['is_weight_mean']:.3f}, max {summary['is_weight_max']:.2f}, "
                                f"truncated {share(summary['is_weight_clip_frac'])}")
    if "migrated_trajectories" in summary and "weight_loads" in summary:
        t.add_row("migrations / weight loads", f"{summary['migrated_trajectories']} trajectories / "
                                               f"{summary['weight_loads']} loads")
    if summary.get("mixed_trajectories"):
        t.add_row("version-mixed trajectories", f"{summary['mixed_trajectories']} (resumed on newer weights)")
    if "unfinished_at_end" in summary:
        t.add_row("unfinished at end", f"{summary['unfinished_at_end']} trajectories (admitted, never consumed)")
    if again:
        resumes = summary.get("resumed_at_steps") or []
        if resumes or summary.get("worker_restarts"):
            t.add_row("recovery", ("resumed after step" + ("s " if len(resumes) > 1 else " ")
                                   + ", ".join(str(r) for r in resumes) if resumes else "never resumed")
                      + f", {summary.get('worker_restarts', 0)} worker restart(s), "
                        f"{summary.get('regenerated_trajectories', 0)} trajectories regenerated (every attempt)")
    elif summary.get("resumed_from_step") is not None or summary.get("worker_restarts"):
        recovery = summary.get("recovery_s") or summary.get("attempt_recovery_s") or []
        t.add_row("recovery", (f"resumed after step {resumed}, " if resumed is not None else "")
                              + f"{summary.get('worker_restarts', 0)} worker restart(s)"
                              + (f" (max {max(recovery):.1f}s)" if recovery else "")
                              + f", {summary.get('regenerated_trajectories', 0)} trajectories regenerated")
    verdict = Text("audit: ", style="bold")
    if audit["ok"]:
        verdict.append(f"ok — {audit['num_consumed']} trajectories consumed, the three constraints hold", style="green")
    else:
        verdict.append(f"{len(audit['violations'])} VIOLATION(S)", style="bold red")
    return Group(t, verdict)
