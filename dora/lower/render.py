"""Render the launch templates from a LaunchContext and write them atomically under ``DIR/launch/``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jinja2

from dora.lower.context import LaunchContext, build_context
from dora.spec.loader import ResolvedSpec
from planner.plan import Plan

LAUNCH_DIR = "launch"
EXECUTABLE = frozenset({f"{LAUNCH_DIR}/launch.sh"})


def template_dir() -> Path:
    """``dora/_data/templates`` in an installed wheel, else the repository's ``templates/``."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_data" / "templates", package.parent / "templates"):
        if (candidate / "launch.sh.j2").is_file():
            return candidate
    raise FileNotFoundError(f"launch templates not found next to {package}")


def environment() -> jinja2.Environment:
    """Strict and literal: an undefined name is an error, and nothing is escaped (values arrive pre-quoted)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())), undefined=jinja2.StrictUndefined,
        autoescape=False, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
    )


def render_context(ctx: LaunchContext) -> dict[str, str]:
    """All artifacts for ``ctx`` as ``{path relative to the plan directory: text}``, sorted by path."""
    env = environment()
    files = {
        f"{LAUNCH_DIR}/job.json": ctx.job_json,
        f"{LAUNCH_DIR}/placement_groups.json": ctx.placement_groups_json,
        f"{LAUNCH_DIR}/runtime.json": ctx.runtime_json,
        f"{LAUNCH_DIR}/launch.sh": env.get_template("launch.sh.j2").render(shell=ctx.shell),
        f"{LAUNCH_DIR}/NOTES.txt": env.get_template("NOTES.txt.j2").render(notes=ctx.notes),
    }
    if ctx.vllm is not None:
        files[f"{LAUNCH_DIR}/vllm/engine_args.json"] = ctx.vllm.engine_args_json
        if ctx.vllm.serve_command is not None:
            files[f"{LAUNCH_DIR}/vllm/serve.args"] = env.get_template("vllm_serve.args.j2").render(vllm=ctx.vllm)
    if ctx.megatron is not None:
        files[f"{LAUNCH_DIR}/megatron/config.json"] = ctx.megatron.config_json
        files[f"{LAUNCH_DIR}/megatron/args.txt"] = env.get_template("megatron_args.txt.j2").render(
            megatron=ctx.megatron)
    return dict(sorted(files.items()))


def render_launch(resolved: ResolvedSpec, plan: Plan) -> dict[str, str]:
    """Render every launch artifact of ``plan`` (deterministic: same inputs, same bytes)."""
    return render_context(build_context(resolved, plan))


def write_launch_artifacts(resolved: ResolvedSpec, plan: Plan, out_dir: Path,
                           files: dict[str, str] | None = None) -> list[Path]:
    """Write ``out_dir/launch/`` (``files``: what ``render_launch`` gives, when already rendered) and return the
    written paths (sorted).

    Everything is rendered first; the files are then written into a fresh temporary directory next to the target
    and swapped in with renames, so a failure leaves the previous ``launch/`` (or none) intact, never a mix.
    The directory is replaced wholesale: files of an earlier lowering that no longer apply disappear.
    """
    files = render_launch(resolved, plan) if files is None else files
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LAUNCH_DIR
    staging = Path(tempfile.mkdtemp(prefix=f".{LAUNCH_DIR}.new-", dir=out_dir))
    try:
        for rel, text in files.items():
            path = staging / Path(rel).relative_to(LAUNCH_DIR)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(path, 0o755 if rel in EXECUTABLE else 0o644)
        os.chmod(staging, 0o755)
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{LAUNCH_DIR}.old-", dir=out_dir))
            os.replace(target, old / LAUNCH_DIR)
        try:
            os.replace(staging, target)
        except BaseException:
            if old is not None:  # put the previous lowering back before reporting the failure
                os.rename(old / LAUNCH_DIR, target)
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted(out_dir / rel for rel in files)
