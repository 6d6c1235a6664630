"""Run a lowered plan on an existing Ray cluster through the Ray Jobs API: submit, follow, status, stop.

`dora apply SPEC --address http://HEAD:8265` lowers the plan into a job directory (``launch/``, with the
run's ``runtime.json``), submits ``launch/job.json``'s entrypoint with that directory as the job's
``working_dir``, streams the job's logs, and exits with its outcome: 0 when it succeeded (the driver's
exit code already includes the audit), 1 when it failed or was stopped, 130 on Ctrl-C (the job keeps
running; `dora stop` stops it). The submission is recorded in ``<output_dir>/job.json`` where
`dora status` and `dora stop` find it. The audit comes back in the logs (the driver's ``DORA_AUDIT``
line) and is written to ``<output_dir>/cluster_audit.json``.

The run's outputs (trace, checkpoints) are written by the job where its ``runtime.json`` says: an absolute
``--output-dir`` on storage the cluster shares keeps them (and lets a killed job resume by submitting the same
command again). A relative one is refused: the job runs in a working directory of its own on the cluster's node, a
temporary one Ray removes. The directory is checked before the cluster is contacted and created before the job is
submitted. A directory another run writes is refused: one whose run lock a run holds, one that holds a local run, and
one whose ``job.json`` names a job the cluster says is not over (or that cannot be asked): a second job would write the
same trace and checkpoints. A head whose job agent has not registered yet (one started moments ago) is tried again for up to a minute. A job that stays PENDING (waiting for resources) is said to, with Ray's message; losing the
cluster while following a job ends the command with exit 1 (the job may still run: `dora status`), and so does a job
the cluster no longer knows; a closed standard output stops the following, not the job (exit 141, as for every
command whose reader went away). The job's working directory,
made here, is removed once the submission is over, whatever its outcome.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dora.runtime.config import RuntimeConfig
from dora.runtime.trace import write_json_atomic
from dora.spec.files import loads_json
from dora.terminal import EXIT_CLOSED_PIPE, error

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130
JOB_FILE = "job.json"
ANSWER_TIMEOUT_S = 30.0
"""How long `dora status`, `dora stop` and a submission wait for the Jobs API to connect (and, for status and stop,
to answer each request). Ray's client has no timeout of its own: on a host that drops packets it waits as long as
the kernel's TCP connect (about two minutes on Linux), and on a server that accepts and never answers, forever."""

T = TypeVar("T")


class ClusterError(Exception):
    """The cluster could not be reached or refused a request (a message, never a traceback)."""


class JobRecordError(ClusterError):
    """The target names no readable job record (bad input: the CLI exits 2, not 1)."""


class JobNotFound(ClusterError):
    """The cluster answered that it has no such job (deleted, or the cluster restarted since it was submitted)."""


RAY_ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
"""Environment variables that Ray's Jobs client lets override the address it is given."""


def _answer_within(what: str, call: Callable[[], T], timeout_s: float | None = None) -> T:
    """``call()``, or ClusterError when it has not returned within ``timeout_s`` (``ANSWER_TIMEOUT_S``). It runs in
    a daemon thread, which is left behind on a timeout: the CLI exits without waiting for it."""
    limit = ANSWER_TIMEOUT_S if timeout_s is None else timeout_s
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="dora-ray-jobs", daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise ClusterError(f"{what}: no answer in {limit:g} s (is the address right, and its dashboard up?)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _client(address: str) -> Any:
    """A Jobs API client for exactly ``address``: Ray's client prefers ``RAY_API_SERVER_ADDRESS`` or ``RAY_ADDRESS``
    from the environment to its argument, which would send `dora status`/`stop` of a recorded job, or a submission
    with an explicit --address, to another cluster. They are hidden while the client resolves the address."""
    from ray.job_submission import JobSubmissionClient

    hidden = {name: os.environ.pop(name) for name in RAY_ADDRESS_VARIABLES if name in os.environ}
    try:
        return _answer_within(f"cannot reach the Ray Jobs API at {address}", lambda: JobSubmissionClient(address))
    except ClusterError:
        raise
    except Exception as exc:  # connection refused, bad URL, auth: all surface as plain errors from Ray
        raise ClusterError(f"cannot reach the Ray Jobs API at {address}: {exc}") from None
    finally:
        os.environ.update(hidden)


def job_directory(resolved: Any, plan: Any, rc: RuntimeConfig, watchdog_s: float | None) -> tuple[Path, dict]:
    """Lower ``plan`` into a fresh directory (the job's working_dir); ``(dir, job submission body)``. The caller
    removes the directory once the submission is over (Ray uploads it during ``submit_job``); it is removed here if
    lowering fails."""
    from dora.lower import write_launch_artifacts

    directory = Path(tempfile.mkdtemp(prefix="dora-job-"))
    try:
        write_launch_artifacts(resolved, plan, directory)
        (directory / "launch" / "runtime.json").write_text(rc.to_json(), encoding="utf-8")  # with the overrides
        body = json.loads((directory / "launch" / JOB_FILE).read_text(encoding="utf-8"))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    entrypoint = body["entrypoint"] + " --no-live"
    if watchdog_s is not None:
        entrypoint += f" --watchdog-s {watchdog_s:g}"
    body["entrypoint"] = entrypoint
    body["runtime_env"] = {**body.get("runtime_env", {}), "working_dir": str(directory)}
    body["runtime_env"].pop("excludes", None)  # the fresh directory holds no outputs
    return directory, body


def output_dir_problem(out: Path) -> str | None:
    """Why the run's output directory cannot be made or written here, or None; creates nothing (a submission checks
    it before contacting the cluster, and creates it only once the cluster answered)."""
    from dora.spec.files import nearest_existing

    try:
        probe = nearest_existing(out)
        if not probe.is_dir():
            return f"{probe} is a file, not a directory"
    except OSError as exc:
        return exc.strerror or str(exc)
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe}/ is not writable"
    return None


def submit_and_follow(address: str, resolved: Any, plan: Any, rc: RuntimeConfig, *, console: Any,
                      watchdog_s: float | None = None, follow: bool = True) -> int:
    """`dora apply --address`: submit, record, stream logs, return the exit code (see the module doc).

    ``rc.output_dir`` is where the job writes (an absolute path on storage the cluster shares: `dora apply` refuses a
    relative one) and where the submission is recorded: it is checked before the cluster is contacted, and created
    before the job is submitted, so a job is never left running with nowhere to record it."""
    out = Path(rc.output_dir)
    fix = "\n  to fix: choose a writable directory with --output-dir (or runtime.output_dir in the spec)"
    if problem := output_dir_problem(out):
        error(console, f"cannot write the run's outputs to {out}/: {problem}{fix}")
        return EXIT_INVALID
    if refusal := _taken(out, rc):
        message, code = refusal
        error(console, message)
        return code
    directory: Path | None = None
    try:
        client = _client(address)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error(console, f"cannot write the run's outputs to {out}/: {exc.strerror or exc}{fix}")
            return EXIT_INVALID
        directory, body = job_directory(resolved, plan, rc, watchdog_s)
        try:
            submission_id = _submit(client, body, console)
        except Exception as exc:  # the Jobs API answers errors as RuntimeError with the server's text
            error(console, f"job submission to {address} failed: {exc}")
            return EXIT_FAILED
    except ClusterError as exc:
        error(console, str(exc))
        return EXIT_FAILED
    finally:  # uploaded by submit_job (or never to be): the local copy is no longer needed
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    try:
        write_json_atomic(out / JOB_FILE, {"address": address, "submission_id": submission_id,
                                           "spec_name": rc.spec_name, "mode": rc.mode, "output_dir": rc.output_dir})
    except OSError as exc:
        error(console, f"submitted {submission_id} to {address}, but cannot record it in {out / JOB_FILE}: "
                       f"{exc.strerror or exc}; `ray job status {submission_id} --address {address}` follows it")
        return EXIT_FAILED
    console.print(f"submitted {submission_id} to {address} (recorded in {out / JOB_FILE}); following its logs — "
                  f"Ctrl-C detaches, `dora stop {out}` stops it", markup=False, highlight=False)
    if not follow:
        return EXIT_OK
    try:
        _wait_started(client, submission_id, console, cpus=body.get("entrypoint_num_cpus"))
        audit = _stream_logs(client, submission_id)
        status = _wait_terminal(client, submission_id)
        info = _ask("get_job_info", lambda: client.get_job_info(submission_id))
    except KeyboardInterrupt:
        console.print(f"detached; the job keeps running: `dora status {out}` / `dora stop {out}`", markup=False)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of the logs went away (`| head`): stop following, not the job
        console.print(f"standard output closed: stopped following {submission_id}; the job keeps running: "
                      f"`dora status {out}` / `dora stop {out}`", markup=False, highlight=False)
        return EXIT_CLOSED_PIPE
    except JobNotFound as exc:
        error(console, f"{address} has no job {submission_id} any more ({exc}): it was deleted, or the cluster "
                       f"restarted; what it wrote is in {out}/")
        return EXIT_FAILED
    except ClusterError as exc:
        error(console, f"lost contact with {address} ({exc}); the job may still be running: `dora status {out}`")
        return EXIT_FAILED
    if audit is not None:
        write_json_atomic(out / "cluster_audit.json", audit)
    console.print(f"job {submission_id}: {status}" + (f" — {info.message}" if info.message else ""),
                  markup=False, highlight=False)
    if status not in TERMINAL_STATUSES:
        error(console, f"its logs ended, but the job is still {status} after {TERMINAL_WAIT_S:g} s: dora stopped "
                       f"waiting; `dora status {out}` follows it")
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED


NO_AGENT = "No available agent to submit job"
"""The start of what Ray's Jobs API answers (HTTP 500) when its head node's job agent has not registered: it waited
10 s for one and asks to be tried again later. A head started moments ago says this until its agent is up."""
AGENT_WAIT_S = 60.0
"""How long a submission refused for want of a job agent is tried again (each try waits up to 10 s on the head)."""


def _submit(client: Any, body: dict, console: Any) -> str:
    """Submit ``body``; the submission id. A refusal for want of a job agent (``NO_AGENT``) is said once and tried
    again until ``AGENT_WAIT_S`` has passed (each try may wait 10 s on the head, so a little longer); any other
    refusal is raised as Ray raised it, and that one past the wait with how long it lasted."""
    started, said = time.monotonic(), False
    while True:
        try:
            return str(client.submit_job(
                entrypoint=body["entrypoint"], runtime_env=body["runtime_env"], metadata=body.get("metadata"),
                entrypoint_num_cpus=body.get("entrypoint_num_cpus"),
                entrypoint_num_gpus=body.get("entrypoint_num_gpus"),
            ))
        except RuntimeError as exc:
            if NO_AGENT not in str(exc):
                raise
            waited = time.monotonic() - started
            if waited >= AGENT_WAIT_S:
                if said:  # Ray's answer says to try later: say dora did, and for how long
                    raise RuntimeError(f"{exc} (refused so for {waited:.0f} s)") from None
                raise
            if not said:
                console.print(f"the cluster's head has no job agent yet (it may have just started): trying again for "
                              f"about {AGENT_WAIT_S:g} s", markup=False, highlight=False)
                said = True
            time.sleep(1.0)


def _taken(out: Path, rc: RuntimeConfig) -> tuple[str, int] | None:
    """Why no job may be submitted into ``out`` (the message and the exit code), or None: a run holds its run lock, it
    holds a local run, its ``job.json`` names a job its cluster does not say is over (or that cannot be asked), or its
    checkpoint is another job's. Only the recorded job's cluster is contacted, and only when there is a record."""
    if not out.is_dir():
        return None
    other = "give this submission another --output-dir"
    if holder := _run_lock_holder(out):
        return (f"{out}/ is in use by a dora run ({holder}): a job submitted into it would write the same trace and "
                f"checkpoints\n  to fix: wait for that run to end or stop it (Ctrl-C; `dora stop {out}` for a submitted "
                f"job), or {other}"), EXIT_FAILED
    record = out / JOB_FILE
    if not record.exists():
        if (out / "runtime.json").exists() or (out / "summary.json").exists():  # what `dora apply` writes locally
            return (f"{out}/ holds a local run, not a submitted job: a job submitted into it would resume or overwrite "
                    f"that run's trace and checkpoints\n  to fix: {other}, or go on with the local run with `dora "
                    "apply` without --address"), EXIT_INVALID
    else:
        try:
            job = find_job(str(out))
        except JobRecordError as exc:
            return f"{exc}\n  to fix: {other}, or remove {record} if no job of it runs", EXIT_INVALID
        named = f"job {job['submission_id']} on {job['address']}"
        status: str | None
        try:
            client = _client(job["address"])
            status = str(_ask(job["address"], lambda: client.get_job_status(job["submission_id"])).value)
        except JobNotFound:  # the cluster no longer has it (deleted, or restarted): nothing of it writes here
            status = None
        except ClusterError as exc:
            return (f"{record} records {named}, and that cluster cannot be asked whether it is over ({exc}): a second "
                    f"job would write the same trace and checkpoints\n  to fix: {other}, or remove {record} once you "
                    "know that job is over"), EXIT_FAILED
        if status is not None and status not in TERMINAL_STATUSES:
            return (f"{out}/ holds {named}, still {status}: a second job would write the same trace and checkpoints"
                    f"\n  to fix: stop it first (`dora stop {out}`) or wait for it (`dora status {out}`), or {other}"
                    ), EXIT_FAILED
    from dora.runtime.checkpoint import CheckpointError, check_resumable

    try:  # the job would refuse it on the cluster, after its submission
        check_resumable(out, json.loads(rc.to_json()))
    except CheckpointError as exc:
        return str(exc), EXIT_INVALID
    return None


def _run_lock_holder(out: Path) -> str | None:
    """Who holds ``out``'s run lock (``dora.runtime.runlock``: a local `dora apply`, or a job's driver writing there),
    as the lock file names it; None when no one does. Only tries the lock, with a shared one that it drops at once,
    and creates nothing."""
    from dora.runtime.runlock import LOCK_FILE

    try:
        fd = os.open(out / LOCK_FILE, os.O_RDONLY)
    except OSError:  # none: no run holds the directory (a run creates the file before it locks it)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "a process"
    finally:
        os.close(fd)  # releases the shared lock, if it was taken
    return None


PENDING_NOTICE_S = 5.0
"""How long a submitted job may stay PENDING (its runtime environment set up, its driver's resources found) before
the wait is said, with Ray's own message."""


def _contact_errors() -> tuple[type[BaseException], ...]:
    """What a Jobs client call raises when the cluster stops answering or answers an error: connection errors
    (``requests``' are ``OSError``s), an HTTP error answered as ``RuntimeError``, the log stream's ``aiohttp``
    errors. Only the client's calls are read this way (``_ask``, the log stream): the same types raised by anything
    else (a closed standard output, asyncio) are not the cluster's."""
    errors: tuple[type[BaseException], ...] = (OSError, RuntimeError)
    try:
        import aiohttp
    except ImportError:
        return errors
    return (*errors, aiohttp.ClientError)


def _cluster_error(exc: BaseException) -> ClusterError:
    """A Jobs client call's error as dora reports it: ``JobNotFound`` for Ray's "Job ... does not exist" (HTTP 404)."""
    reason = _reason(exc)
    return JobNotFound(reason) if "does not exist" in str(exc) else ClusterError(reason)


def _ask(what: str, call: Callable[[], T]) -> T:
    """``call()``, one Jobs client call, within ``ANSWER_TIMEOUT_S``; what it raises for the cluster's part as
    ``ClusterError`` (``JobNotFound``: the cluster has no such job)."""
    try:
        return _answer_within(what, call)
    except ClusterError:
        raise
    except _contact_errors() as exc:
        raise _cluster_error(exc) from None


def _reason(exc: BaseException) -> str:
    """The error in one short line (``requests``' connection errors run to several hundred characters)."""
    text = " ".join(str(exc).split())
    if "Connection refused" in text or "ConnectionRefused" in text:
        text = "connection refused"
    elif len(text) > 160:
        text = text[:160] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _wait_started(client: Any, submission_id: str, console: Any, *, cpus: Any = None) -> None:
    """Return once the job has left PENDING. While it waits longer than ``PENDING_NOTICE_S``, print Ray's status
    message (resources, runtime environment), and again each time it changes: a job that waits for CPUs the cluster
    lacks otherwise waits in silence (Ray fails it after RAY_JOB_START_TIMEOUT_SECONDS, 15 minutes by default)."""
    started, said = time.monotonic(), None
    while True:
        info = _ask("get_job_info", lambda: client.get_job_info(submission_id))
        if str(info.status.value) != "PENDING":
            return
        message = info.message or "(Ray gives no reason)"
        if time.monotonic() - started >= PENDING_NOTICE_S and message != said:
            asks = f" Its driver asks for {cpus:g} CPU (entrypoint_num_cpus); `ray status` on the cluster shows what " \
                   "is free." if isinstance(cpus, int | float) and said is None else ""
            console.print(f"job {submission_id}: PENDING — {message}{asks}", markup=False, highlight=False)
            said = message
        time.sleep(1.0)


def _stream_logs(client: Any, submission_id: str) -> dict[str, Any] | None:
    """Print the job's logs as they come; the driver's audit line, parsed (``None`` if it never came, or came
    unreadable). A chunk may end inside a line: the rest of it comes with the next. The stream's errors are the
    cluster's (``ClusterError``); printing's are not (a closed standard output raises ``BrokenPipeError``)."""
    from dora.runtime.driver import AUDIT_PREFIX

    audit: dict[str, Any] | None = None
    partial = ""

    def scan(line: str) -> None:
        nonlocal audit
        if line.startswith(AUDIT_PREFIX):
            try:
                audit = loads_json(line[len(AUDIT_PREFIX):])  # a ValueError also for nesting too deep to parse
            except ValueError:
                audit = None

    async def follow() -> None:
        nonlocal partial
        chunks = aiter(client.tail_job_logs(submission_id))
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except _contact_errors() as exc:
                raise _cluster_error(exc) from None
            print(chunk, end="", flush=True)
            lines = (partial + chunk).split("\n")
            partial = lines.pop()
            for line in lines:
                scan(line.rstrip("\r"))

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # none in this thread (the CLI): the stream gets a loop of its own
        asyncio.run(follow())
    else:  # called from async code (a notebook), where asyncio.run refuses to start a loop: one in a thread of its own
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dora-logs")
        try:
            pool.submit(asyncio.run, follow()).result()
        finally:
            pool.shutdown(wait=False)  # after Ctrl-C the caller goes on; the stream ends with the job
    scan(partial)
    return audit


TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
TERMINAL_WAIT_S = 60.0
"""How long after a job's log stream ends dora waits for its final status (the driver exits a moment later)."""


def _wait_terminal(client: Any, submission_id: str, timeout_s: float = TERMINAL_WAIT_S) -> str:
    """The job's status once final, or whatever it is after ``timeout_s`` (the caller says it stopped waiting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(_ask("get_job_status", lambda: client.get_job_status(submission_id)).value)
        if status in TERMINAL_STATUSES or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def find_job(target: str) -> dict[str, Any]:
    """The recorded submission for ``target``: a run's output directory, its ``job.json``, or the spec."""
    path = Path(target)
    if path.is_dir():
        path = path / JOB_FILE
    elif path.suffix in (".yaml", ".yml"):
        from dora.spec import SpecError, load_spec

        try:
            path = Path(load_spec(str(path)).output_dir) / JOB_FILE
        except SpecError as exc:
            n = len(exc.diagnostics)
            raise JobRecordError(f"{target}: cannot read the spec for its output_dir ({n} problem{'s' if n != 1 else ''}"
                               f"; `dora validate {target}` lists them); or pass the run's output directory") from None
    if not path.is_file():
        local = path.parent / "summary.json"
        if local.is_file():
            raise JobRecordError(f"{path.parent}/ holds a local run, not a submitted job: its results are in {local}")
        raise JobRecordError(f"no submitted job recorded at {path}: `dora apply SPEC --address URL` records one there")
    try:
        data = loads_json(path.read_text(encoding="utf-8"))  # a ValueError also for nesting too deep to parse
        if not isinstance(data, dict):
            held = json.dumps(data)[:40]
            raise JobRecordError(f"{path} is not a dora job record: it holds {held} instead of an object with address "
                                 "and submission_id") from None
        job = {"address": str(data["address"]), "submission_id": str(data["submission_id"]), "file": str(path)}
    except KeyError as exc:
        raise JobRecordError(f"{path} is not a dora job record: it has no {exc} field") from None
    except (OSError, ValueError, TypeError) as exc:
        raise JobRecordError(f"{path} is not a dora job record: {exc}") from None
    from dora.spec.checks import address_problem

    if problem := address_problem(job["address"]):  # dora records only valid ones: the file was edited
        raise JobRecordError(f"{path}: its address {job['address']!r} {problem}")
    return job


def job_status(target: str) -> dict[str, Any]:
    job = find_job(target)
    client = _client(job["address"])
    try:
        info = _answer_within(job["address"], lambda: client.get_job_info(job["submission_id"]))
    except ClusterError:
        raise
    except Exception as exc:
        raise ClusterError(f"{job['address']}: cannot get job {job['submission_id']}: {exc}") from None
    return {**job, "status": str(info.status.value), "message": info.message or "",
            "entrypoint": info.entrypoint}


def stop_job(target: str) -> dict[str, Any]:
    job = find_job(target)
    client = _client(job["address"])
    try:
        stopped = bool(_answer_within(job["address"], lambda: client.stop_job(job["submission_id"])))
        status = _answer_within(job["address"], lambda: client.get_job_status(job["submission_id"]))
    except ClusterError:
        raise
    except Exception as exc:
        raise ClusterError(f"{job['address']}: cannot stop job {job['submission_id']}: {exc}") from None
    return {**job, "stop_requested": stopped, "status": str(status.value)}


__all__ = ["ClusterError", "JobRecordError", "find_job", "job_status", "stop_job", "submit_and_follow"]
