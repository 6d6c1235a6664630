"""Render the launch templates from a LaunchContext and write them atomically under ``DIR/launch/``; write a
set of files into a directory all or nothing (``install_files``, also `dora plan --out`'s writer)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

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


def launch_modes(files: Mapping[str, str]) -> dict[str, int]:
    """The permissions of ``launch/`` and of each launch artifact in ``files`` (``render_launch``'s output)."""
    return {LAUNCH_DIR: 0o755, **{rel: 0o755 if rel in EXECUTABLE else 0o644 for rel in files}}


def write_launch_artifacts(resolved: ResolvedSpec, plan: Plan, out_dir: Path,
                           files: dict[str, str] | None = None) -> list[Path]:
    """Write ``out_dir/launch/`` (``files``: what ``render_launch`` gives, when already rendered) and return the
    written paths (sorted).

    All or nothing (``install_files``): a failure leaves the previous ``launch/`` (or none, and no ``out_dir`` if
    there was none) intact, never a mix. The directory is replaced wholesale: files of an earlier lowering that no
    longer apply disappear; a file or symbolic link named ``launch`` (not dora's) is refused, never deleted.
    """
    files = render_launch(resolved, plan) if files is None else files
    out_dir = Path(out_dir)
    install_files(out_dir, files, launch_modes(files))
    return sorted(out_dir / rel for rel in files)


# ----------------------------------------------------------------------------- all-or-nothing writing
STAGING_PREFIX, BACKUP_PREFIX = ".dora-new-", ".dora-old-"
STAGING_NAME_CHARS = 32
"""How much of the output directory's name a staging directory beside it carries (``.NAME.dora-new-XXXXXXXX``):
enough to tell whose it is, short enough that any name the filesystem allows for the directory fits."""


def install_files(out_dir: Path, files: Mapping[str, str], modes: Mapping[str, int] | None = None) -> None:
    """Write ``files`` (``{POSIX path relative to out_dir: text}``) into ``out_dir``, all or nothing.

    dora owns the top-level entries the paths name (``plan.json``, ``launch/``, ...): each is replaced as a whole —
    a directory wholesale, so files of an earlier write that no longer apply disappear. Every other entry of
    ``out_dir`` is left alone. Refused before anything is written: an ``out_dir`` that is not a directory, a
    directory where a file goes, and anything but a directory (a file, a symbolic link) where a directory goes —
    dora never writes those, so they are not dora's to delete.

    Everything is written into a temporary directory on the same filesystem first — inside ``out_dir``, or next to
    it when it does not exist yet — and only then renamed into place: the previous entries are moved aside, the
    new ones moved in, and the previous ones deleted. On any failure the previous entries are put back, so
    ``out_dir`` is exactly as it was (absent, with any parents this call made, if it was absent). ``modes``:
    permissions by relative path, for files and directories; other files get ``0o666`` less the umask.
    """
    out_dir = Path(out_dir)
    modes = dict(modes or {})
    umask = _umask()
    tops: dict[str, bool] = {}  # top-level name -> whether it is a directory
    for rel in files:
        parts = PurePosixPath(rel).parts
        if not parts or parts[0] in (".", "..") or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise ValueError(f"not a path inside the output directory: {rel!r}")
        tops[parts[0]] = tops.get(parts[0], False) or len(parts) > 1
    _check_targets(out_dir, tops)
    _check_name_lengths(out_dir)
    fresh = not os.path.lexists(out_dir)
    created = _make_parents(out_dir.parent) if fresh else []
    staging: Path | None = None
    try:
        home = out_dir.parent if fresh else out_dir
        if not home.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(home))
        staging = _mkdtemp(home, f".{out_dir.name[:STAGING_NAME_CHARS]}{STAGING_PREFIX}" if fresh else STAGING_PREFIX)
        try:
            for rel, text in files.items():
                _write_file(staging / rel, text, modes.get(rel, 0o666 & ~umask))
            for rel, mode in modes.items():
                if rel not in files and (staging / rel).is_dir():
                    os.chmod(staging / rel, mode)
            if fresh:
                os.chmod(staging, 0o777 & ~umask)  # as mkdir would have made it
                os.replace(staging, out_dir)
            else:
                _swap(out_dir, staging, sorted(tops))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except OSError as exc:
        _rmdirs(created)
        _name_the_target(exc, staging, out_dir)
        raise
    except BaseException:
        _rmdirs(created)
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _check_targets(out_dir: Path, tops: Mapping[str, bool]) -> None:
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        if out_dir.is_symlink():
            raise FileExistsError(errno.EEXIST, "a broken symbolic link is in the way", str(out_dir))
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(out_dir))
    if not out_dir.is_dir():
        return
    for name, is_dir in tops.items():
        target = out_dir / name
        if is_dir:
            if os.path.lexists(target) and not stat.S_ISDIR(target.lstat().st_mode):
                raise FileExistsError(errno.EEXIST, f"something dora did not write is in the way of its {name}/ "
                                                    "directory", str(target))
        elif target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "a directory is in the way of a plan file", str(target))


def _check_name_lengths(out_dir: Path) -> None:
    """Refuse, naming it, a directory to create (``out_dir`` or a missing parent) whose name is longer than its
    filesystem allows: mkdir would fail with a bare "File name too long" after the parents before it were made."""
    missing = []
    directory = out_dir
    while not os.path.lexists(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for path in reversed(missing):
        size = len(os.fsencode(path.name))
        if size > limit:
            raise OSError(errno.ENAMETOOLONG, f"File name too long: {size} bytes, and this filesystem allows at most "
                                              f"{limit}", str(path))


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; the ones created, outermost first."""
    missing = []
    while not os.path.lexists(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    created = []
    try:
        for path in reversed(missing):
            path.mkdir()
            created.append(path)
    except BaseException:
        _rmdirs(created)
        raise
    return created


def _rmdirs(created: list[Path]) -> None:
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:
            break


def _mkdtemp(directory: Path, prefix: str) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    except OSError as exc:  # named after the directory, not the random name it tried
        exc.filename = str(directory)
        raise


def _write_file(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(path, mode)


def _swap(out_dir: Path, staging: Path, names: list[str]) -> None:
    """Move each of ``names`` from ``staging`` into ``out_dir``, the previous entries aside first; on failure put
    everything back. The previous entries are deleted only once every new one is in place."""
    backup = _mkdtemp(out_dir, BACKUP_PREFIX)
    moved: list[str] = []  # previous entries now in backup
    placed: list[str] = []  # new entries now in out_dir
    try:
        for name in names:
            if os.path.lexists(out_dir / name):
                os.replace(out_dir / name, backup / name)
                moved.append(name)
            os.replace(staging / name, out_dir / name)
            placed.append(name)
    except BaseException:  # undo, newest first (os.rename: the same call as os.replace, on POSIX)
        restored = True
        for name in reversed(placed):
            try:
                os.rename(out_dir / name, staging / name)  # the caller deletes staging
            except OSError:
                restored = False
        for name in reversed(moved):
            try:
                os.rename(backup / name, out_dir / name)
            except OSError:
                restored = False
        if restored:  # otherwise the previous files stay in the backup: nothing is lost
            shutil.rmtree(backup, ignore_errors=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


def _name_the_target(exc: OSError, staging: Path | None, out_dir: Path) -> None:
    """Name the file the user asked for in ``exc``, not its temporary copy."""
    for attr in ("filename", "filename2"):
        name = getattr(exc, attr)
        if staging is None or not isinstance(name, str):
            continue
        if name == str(staging) or name.startswith(str(staging) + os.sep):
            setattr(exc, attr, str(out_dir / os.path.relpath(name, staging)))
