"""Checkpoints and resume: a killed ``dora apply`` re-run with the same command continues where it stopped.

What is saved, after warm-up (step 0) and after every training step ``s``, under ``<output_dir>/checkpoint/``:

- ``trainer-<s>.pt``: the trainer's weights, optimizer state, step and version counter (``TorchTrainer.state_dict``);
- ``checkpoint.json``: ``s``, the data groups steps ``1..s`` consumed, that step's ``train_step`` trace event
  and ``metrics.jsonl`` row, and the run-config key (a checkpoint never resumes a different job).

Commit order (each file written to a temporary name, fsynced, then renamed): the trainer file, then
``checkpoint.json`` (the commit point), then the step's trace event and metrics row. A crash after the commit
leaves a checkpoint whose step the trace or the metrics lack; resume writes them from the checkpoint.

Resume semantics (the audit of the combined, append-only trace proves them):

- The trainer restarts from ``s`` (weights, optimizer, version ``s``): nothing trained is lost or retrained.
- The data position: prompt group ``g`` is a pure function of ``(seed, g)``. Every group admitted before
  the crash (read from the trace) that no step ``<= s`` consumed is **regenerated**, same prompt, on
  version ``s`` (a ``regenerated`` event, then ``admitted``), before any new group -- unfinished and
  finished-but-untrained alike, so the long tail is not biased away. New groups continue after the
  highest id ever admitted.
- The scheduling policy restarts as a fresh state machine whose version 0 is global version ``s``
  and whose first step is ``s + 1`` (what a fresh run does at version 0, shifted). The staleness bound
  holds across the seam: regenerated groups are on version ``s``, trained by steps ``>= s + 1``.
- The sample buffer and in-flight generations of the dead attempt are therefore not reloaded but
  regenerated: their tokens came from processes that no longer exist, and a partial buffer restored
  next to a fresh policy would let one group be counted twice.
- Every trajectory the stopped attempt admitted and left neither trained nor accounted for (a kill skips the
  ``unfinished_at_end`` events of a run's end) gets its ``unfinished_at_end`` event at the seam, with whether it
  had finished, as the attempt's end would have written it. The trace then accounts for every admission however the
  attempt stopped: a regeneration supersedes the event, and an attempt that already trained every step (a kill after
  the last commit) passes its audit.
- The trace's clock continues from its last event (the trace stays ordered); ``resumed`` marks the seam.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dora.runtime.trace import JsonlError, read_jsonl, write_json_atomic
from dora.spec.files import loads_json

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_FILE = "checkpoint.json"
FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed (unreadable, another job's, or another format)."""


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    step: int
    consumed_groups: tuple[int, ...]
    """Data group ids consumed by steps ``1..step``."""
    trainer_state: str
    """File name of the trainer state, in the checkpoint directory."""
    step_event: dict[str, Any] | None
    """The ``train_step`` trace event of ``step`` (``None`` at step 0)."""
    metrics_row: dict[str, Any] | None = None
    """The ``metrics.jsonl`` row of ``step`` (``None`` at step 0, and in checkpoints written before 2026-11-22)."""
    config_key: str

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "consumed_groups": sorted(self.consumed_groups),
                "trainer_state": self.trainer_state, "step_event": self.step_event, "metrics_row": self.metrics_row,
                "config_key": self.config_key}


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """Where a resumed attempt starts (see the module doc)."""

    step: int
    trainer_state: Path
    consumed_groups: frozenset[int]
    regenerate: tuple[int, ...]
    """Data groups admitted before, not consumed by steps ``<= step``: re-admitted first, in id order."""
    next_group: int
    """First data group id never admitted."""
    clock_s: float
    """This attempt's trace clock starts here (just after the trace's last event)."""


RESUMABLE_CHANGES = ("steps", "output_dir", "spec_hash")
"""Runtime-config fields an attempt may change and still resume: the step count, the output place, and the spec's
hash (it covers ``workload.steps`` and fields the run never reads, like the price; every field the run reads is in
the runtime config itself)."""


def config_key(runtime_json: dict[str, Any], ignore: tuple[str, ...] = RESUMABLE_CHANGES) -> str:
    """Hash of the runtime config minus what may change between attempts (``RESUMABLE_CHANGES``; until 2026-11 the
    spec hash was not among them, and ``_changed_settings`` still reads checkpoints keyed that way)."""
    data = {k: v for k, v in runtime_json.items() if k not in ignore}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def write_checkpoint(output_dir: Path, ckpt: Checkpoint) -> None:
    """Commit ``ckpt`` (its trainer file must already be written), then drop older trainer files, and the temporary
    files of saves a kill cut short (the trainer saves one step at a time, and the commit comes between two saves)."""
    directory = checkpoint_dir(output_dir)
    write_json_atomic(directory / CHECKPOINT_FILE, ckpt.to_json())
    for old in directory.glob("trainer-*.pt"):
        if old.name != ckpt.trainer_state:
            old.unlink(missing_ok=True)
    for cut in directory.glob(".trainer-*.tmp"):
        cut.unlink(missing_ok=True)


def read_checkpoint(output_dir: Path) -> Checkpoint | None:
    path = checkpoint_dir(output_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {data.get('format')!r}, this dora reads {FORMAT}")
        ckpt = Checkpoint(step=int(data["step"]), consumed_groups=tuple(int(g) for g in data["consumed_groups"]),
                          trainer_state=str(data["trainer_state"]), step_event=data["step_event"],
                          metrics_row=data.get("metrics_row"), config_key=str(data["config_key"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc}); delete {path.parent} to start over") from None
    if not (checkpoint_dir(output_dir) / ckpt.trainer_state).exists():
        raise CheckpointError(f"{path}: its trainer state {ckpt.trainer_state} is missing; delete {path.parent} "
                              "to start over")
    return ckpt


def repair_jsonl_tail(path: Path) -> None:
    """Cut a half-written last line (the writer was killed mid-write) so appends start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def check_resumable(output_dir: Path, runtime_json: dict[str, Any]) -> Checkpoint | None:
    """The checkpoint in ``output_dir`` (``None`` if there is none) if this job may resume it; reads only.

    Raises ``CheckpointError`` when it is another job configuration's checkpoint, or when the files a resume reads are
    damaged (``_check_run_files``): refused here, before anything is written, the run's files stay as they were."""
    ckpt = read_checkpoint(output_dir)
    if ckpt is not None and ckpt.config_key != config_key(runtime_json):
        raise CheckpointError(
            f"{checkpoint_dir(output_dir)} holds a checkpoint of a different job configuration"
            f"{_changed_settings(Path(output_dir) / 'runtime.json', ckpt.config_key, runtime_json)}; resume it with "
            "the spec and overrides it ran with (add --steps N for another step count), or use another --output-dir")
    if ckpt is not None:
        _check_run_files(Path(output_dir), ckpt)
    return ckpt


def _check_run_files(output_dir: Path, ckpt: Checkpoint) -> None:
    """Refuse (``CheckpointError``) to resume from files that would make a wrong run: a trainer file that is not a
    whole ``torch.save`` archive (a zip: its directory is at the end, so a cut file fails here, cheaply, where the
    trainer's load would fail only after the trace was written to); a line of the trace or the metrics that is not
    JSON (the resume rewrites the metrics from what it reads); a trace without the steps the checkpoint holds (the
    groups admitted before the crash, which the resume regenerates, are read from it)."""
    directory = checkpoint_dir(output_dir)
    trainer = directory / ckpt.trainer_state
    try:
        zipfile.ZipFile(trainer).close()  # opening reads the archive's directory, at its end
    except (OSError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{trainer}: unreadable trainer state ({exc}); delete {directory} to start over") \
            from None
    trace = output_dir / "trace.jsonl"
    events = _read_run_file(trace, directory) if trace.exists() else []
    if (output_dir / "metrics.jsonl").exists():
        _read_run_file(output_dir / "metrics.jsonl", directory)
    traced = {e.get("step") for e in events if e.get("type") == "train_step"}
    if ckpt.step_event is not None:
        traced.add(ckpt.step)  # a kill after the commit may have lost it: the resume writes it from the checkpoint
    lacking = [s for s in range(1, ckpt.step + 1) if s not in traced]
    if lacking:
        what = (f"does not hold this checkpoint's steps: no train_step event for step{'s' if len(lacking) > 1 else ''} "
                f"{_ranges(lacking)} of the {ckpt.step} it holds" if trace.exists()
                else f"is missing, and the checkpoint holds {ckpt.step} step{'s' if ckpt.step > 1 else ''}")
        raise CheckpointError(f"{trace} {what}: the data groups admitted before the stop, which the trace names, "
                              f"cannot be regenerated; {_fix(trace, directory)}")


def _read_run_file(path: Path, directory: Path) -> list[dict[str, Any]]:
    try:
        return read_jsonl(path)
    except JsonlError as exc:
        raise CheckpointError(f"{exc}: the run cannot be resumed from it; {_fix(path, directory)}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc}); {_fix(path, directory)}") from None


def _fix(path: Path, directory: Path) -> str:
    return f"restore {path.name} as the run wrote it, or delete {directory} to start over"


def _ranges(steps: list[int]) -> str:
    """'1-3, 7' for [1, 2, 3, 7]."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def resume_hint(output_dir: Path) -> str:
    """After an interrupted run, what is committed and how to go on (``"; ..."``, to end a message)."""
    try:
        ckpt = read_checkpoint(output_dir)
    except CheckpointError:
        return ""
    if ckpt is None:
        return "; no step was committed yet"
    return f"; step {ckpt.step} is committed: run the same command again to resume after it"


def _changed_settings(previous_file: Path, key: str, runtime_json: dict[str, Any]) -> str:
    """' (mode: "streaming" -> "sync", model.norm_eps: (none) -> 1e-06, ...)': the fields that differ from the run's
    recorded runtime.json, when it is readable; a checkpoint from another dora release says so first."""
    from dora.report import brief_changes, tree_diff

    try:
        previous = loads_json(previous_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(previous, dict) or key not in (config_key(previous), config_key(previous, ("steps", "output_dir"))):
        return ""  # not the configuration the checkpoint was written with
    skip = (*RESUMABLE_CHANGES, "format_version")
    changes = tree_diff({k: v for k, v in previous.items() if k not in skip},
                        {k: v for k, v in runtime_json.items() if k not in skip})
    changes.sort(key=lambda c: c[1] != "mode")  # stable: then in path order
    was, now = previous.get("format_version"), runtime_json.get("format_version")
    parts = [f"written by another dora release (runtime format {was}, this one writes {now})"] if was != now else []
    if changes:
        parts.append(brief_changes(changes))
    return f" ({'; '.join(parts)})" if parts else ""


def unaccounted(events: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """``[(traj, finished)]``, in id order: the trajectories of ``events`` admitted, and since their last
    (re)generation neither consumed by a step nor accounted for (``unfinished_at_end``, ``discarded``); ``finished``:
    whether they had finished. What the ``unfinished_at_end`` events of an attempt's end (``Controller._close``)
    cover, so empty after an attempt that ended; a killed attempt leaves them."""
    open_: dict[str, bool] = {}
    seen: set[str] = set()
    for e in events:
        kind, traj = e.get("type"), str(e.get("traj"))
        if kind == "regenerated" or (kind == "admitted" and traj not in seen):
            seen.add(traj)
            open_[traj] = False
        elif kind == "finished" and traj in open_:
            open_[traj] = True
        elif kind in ("unfinished_at_end", "discarded"):
            open_.pop(traj, None)
        elif kind == "train_step":
            for consumed in e["consumed"]:
                open_.pop(consumed, None)
    return sorted(open_.items(), key=lambda item: tuple(int(n) for n in item[0][1:].split("/")))


def _append(path: Path, events: list[dict[str, Any]]) -> None:
    """Append ``events`` to the trace in one write, then fsync. A kill halfway through leaves a cut last line, which
    the next resume repairs before writing what is still missing again."""
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n" for e in events))
        f.flush()
        os.fsync(f.fileno())


def prepare_resume(output_dir: Path, runtime_json: dict[str, Any]) -> ResumePoint | None:
    """The resume point of ``output_dir``, or ``None`` for a fresh run (no checkpoint yet).

    Repairs the trace tail and writes the checkpointed step's event if the crash lost it, then the
    ``unfinished_at_end`` events the stopped attempt did not write (``unaccounted``: a kill before its end); keeps only
    the metrics rows of checkpointed steps, and writes the checkpointed step's row if the crash lost it. Raises
    ``CheckpointError`` for another job's checkpoint, and for damaged files (``check_resumable``).
    """
    ckpt = check_resumable(output_dir, runtime_json)
    if ckpt is None:
        return None
    trace = Path(output_dir) / "trace.jsonl"
    repair_jsonl_tail(trace)
    events = read_jsonl(trace) if trace.exists() else []
    steps = {e["step"] for e in events if e.get("type") == "train_step"}
    later = sorted(s for s in steps if s > ckpt.step)
    if later:  # the commit order makes this impossible unless files were edited or mixed up
        raise CheckpointError(f"{trace} records steps {later} after the checkpoint's step {ckpt.step}: not this "
                              "run's checkpoint; use another --output-dir")
    clock = max((float(e.get("t", 0.0)) for e in events), default=0.0)
    missing: list[dict[str, Any]] = []
    if ckpt.step_event is not None and ckpt.step not in steps:
        missing.append(ckpt.step_event)
        clock = max(clock, float(ckpt.step_event["t"]))
    missing += [{"t": clock, "type": "unfinished_at_end", "traj": traj, "finished": finished}
                for traj, finished in unaccounted(events + missing)]
    if missing:
        _append(trace, missing)
    admitted = {int(e["traj"][1:].split("/")[0]) for e in events if e.get("type") == "admitted"}
    consumed = frozenset(ckpt.consumed_groups)
    metrics = Path(output_dir) / "metrics.jsonl"
    if metrics.exists():
        repair_jsonl_tail(metrics)
        rows = [r for r in read_jsonl(metrics) if r.get("step", 0) <= ckpt.step]
        if ckpt.metrics_row is not None and all(r.get("step") != ckpt.step for r in rows):
            rows.append(ckpt.metrics_row)
        from dora.runtime.trace import write_text_atomic

        write_text_atomic(metrics, "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n"
                                           for r in rows))
    return ResumePoint(
        step=ckpt.step, trainer_state=checkpoint_dir(output_dir) / ckpt.trainer_state, consumed_groups=consumed,
        regenerate=tuple(sorted(admitted - consumed)), next_group=max(admitted | consumed, default=-1) + 1,
        clock_s=clock + 1e-3,
    )


__all__ = ["Checkpoint", "CheckpointError", "ResumePoint", "check_resumable", "config_key", "prepare_resume",
           "read_checkpoint", "resume_hint", "unaccounted", "write_checkpoint"]
