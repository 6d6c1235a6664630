"""Load a spec file: parse YAML, validate, run cross-field checks, resolve referenced files.

``load_spec`` is the only place the spec layer does I/O: the spec file, a Hugging Face config.json and
length-histogram files. It collects every problem it can find and raises them together as ``SpecError``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import Any

from pydantic import ValidationError

from dora.spec.checks import check_context, check_lengths, check_placement, check_spec, check_spec_staleness
from dora.spec.diagnostics import Diagnostic, Path, SpecError
from dora.spec.errors import closest_field, diagnostics_from_validation, stray_keys
from dora.spec.files import InputFileError, loads_json, read_input_file
from dora.spec.models import ArchitectureSpec, LengthSpec, Spec, StalenessSpec
from dora.spec.yamlio import MAX_FILE_BYTES, YamlDoc, parse_yaml
from planner.architecture import MLA, HFConfigError, ModelArch, arch_from_hf_config, get_preset
from planner.workload import LengthDistribution

MAX_SIDE_FILE_BYTES = 4 << 20
"""Largest config.json or histogram file read."""


@dataclass(frozen=True, kw_only=True)
class ResolvedSpec:
    """A validated spec with its references resolved: what the planner consumes."""

    spec: Spec
    arch: ModelArch
    prompt_lengths: LengthDistribution
    response_lengths: LengthDistribution
    file: str
    """The spec path as given on the command line."""
    spec_hash: str
    """sha256 of the canonical resolved content (spec values, architecture, histograms); comments don't count."""
    inputs: dict[str, Any]
    """What the hash covers, as plain JSON: ``spec`` (validated, defaults filled in), ``arch`` (resolved) and
    ``files`` (a digest of each referenced file's content, None where the spec reads none); plans record it."""

    @property
    def output_dir(self) -> str:
        return self.spec.runtime.output_dir or f"runs/{slug(self.spec.name)}"


def slug(name: str) -> str:
    """A conservative identifier from a free-text name: [a-z0-9-], at most 48 characters."""
    out = "".join(c if c.isascii() and c.isalnum() else "-" for c in name.lower())
    out = "-".join(p for p in out.split("-") if p)[:48].strip("-")
    return out or "job"


def arch_from_fields(a: ArchitectureSpec, name: str) -> ModelArch:
    heads = a.num_attention_heads
    mla = None
    if a.mla is not None:
        mla = MLA(q_lora_rank=a.mla.q_lora_rank, kv_lora_rank=a.mla.kv_lora_rank,
                  qk_nope_head_dim=a.mla.qk_nope_head_dim, qk_rope_head_dim=a.mla.qk_rope_head_dim,
                  v_head_dim=a.mla.v_head_dim)
    # an MLA model caches a latent, not KV heads, and its query/key head is nope + rope wide (as config.json reads)
    kv_heads = heads if mla is not None else a.num_kv_heads or heads
    head_dim = (mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla is not None
                else a.head_dim or a.hidden_size // heads)
    return ModelArch(
        name=name, num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        ffn_hidden_size=a.ffn_hidden_size, vocab_size=a.vocab_size, tie_embeddings=a.tie_embeddings,
        qkv_bias=a.qkv_bias, qk_norm=a.qk_norm, rope_theta=a.rope_theta, norm_eps=a.norm_eps,
        num_experts=a.num_experts, experts_top_k=a.experts_top_k,
        num_shared_experts=a.num_shared_experts, moe_ffn_hidden_size=a.moe_ffn_hidden_size,
        first_dense_layers=a.first_dense_layers, mla=mla,
    )


def _architecture_checks(a: ArchitectureSpec) -> list[Diagnostic]:
    out = []
    base = ("model", "architecture")
    if a.mla is not None:  # what an MLA model's own fields size: these would contradict them, or size nothing
        mla_sized = {"num_kv_heads": "MLA caches one latent per token, not KV heads (every head reads it)",
                     "head_dim": "MLA's query/key head is mla.qk_nope_head_dim + mla.qk_rope_head_dim wide, its "
                                 "value head mla.v_head_dim",
                     "qkv_bias": "MLA's projections have no biases in dora's cost model or its Megatron lowering",
                     "qk_norm": "MLA normalises its latents, not per-head q and k"}
        for field, why in mla_sized.items():
            if getattr(a, field):
                out.append(Diagnostic(path=(*base, field), message=f"{field} is set beside mla: {why}",
                                      hint=f"remove {field} (the mla ranks size the attention)"))
        if a.mla.qk_rope_head_dim % 2:
            out.append(Diagnostic(path=(*base, "mla", "qk_rope_head_dim"), message=(
                f"qk_rope_head_dim ({a.mla.qk_rope_head_dim}) is odd: RoPE rotates pairs of dimensions"),
                hint="give an even qk_rope_head_dim (64 in DeepSeek-V3)"))
        return out + _moe_checks(a, base)
    if (a.head_dim or 0) % 2:
        out.append(Diagnostic(path=(*base, "head_dim"), message=(
            f"head_dim ({a.head_dim}) is odd: RoPE rotates pairs of dimensions"), hint="give an even head_dim"))
    if a.head_dim is None and a.hidden_size % a.num_attention_heads:
        out.append(Diagnostic(path=(*base, "head_dim"), message=(
            f"head_dim is unset and num_attention_heads ({a.num_attention_heads}) does not divide hidden_size "
            f"({a.hidden_size}): {a.hidden_size} % {a.num_attention_heads} = {a.hidden_size % a.num_attention_heads}"),
            hint="set head_dim explicitly"))
    kv = a.num_kv_heads or a.num_attention_heads
    if a.num_attention_heads % kv:
        out.append(Diagnostic(path=(*base, "num_kv_heads"), message=(
            f"num_kv_heads ({kv}) does not divide num_attention_heads ({a.num_attention_heads})"),
            hint="GQA groups query heads evenly: choose a divisor of num_attention_heads"))
    if a.head_dim is None and not a.hidden_size % a.num_attention_heads and (a.hidden_size // a.num_attention_heads) % 2:
        out.append(Diagnostic(path=(*base, "head_dim"), message=(
            f"head_dim is unset, and hidden_size / num_attention_heads = {a.hidden_size // a.num_attention_heads} is "
            "odd: RoPE rotates pairs of dimensions"), hint="set an even head_dim explicitly"))
    return out + _moe_checks(a, base)


def _moe_checks(a: ArchitectureSpec, base: tuple[str, ...]) -> list[Diagnostic]:
    out = []
    moe_fields = [name for name in ("experts_top_k", "num_shared_experts", "moe_ffn_hidden_size", "first_dense_layers")
                  if getattr(a, name)]
    if a.num_experts == 0 and moe_fields:
        out.append(Diagnostic(path=(*base, "num_experts"), message=f"{', '.join(moe_fields)} set but num_experts is 0 "
                              "(a dense model, which would ignore them)",
                              hint="set num_experts for an MoE model, or remove the MoE fields"))
    if a.num_experts > 0:
        if not 0 < a.experts_top_k <= a.num_experts:
            out.append(Diagnostic(path=(*base, "experts_top_k"), message=(
                f"experts_top_k must be in 1..num_experts ({a.num_experts}), got {a.experts_top_k}"),
                hint="set how many routed experts each token uses"))
        if a.moe_ffn_hidden_size == 0:
            out.append(Diagnostic(path=(*base, "moe_ffn_hidden_size"), message="an MoE model needs the expert size",
                                  hint="set moe_ffn_hidden_size (intermediate size of one expert)"))
        if a.first_dense_layers >= a.num_layers:
            out.append(Diagnostic(path=(*base, "first_dense_layers"), message=(
                f"first_dense_layers ({a.first_dense_layers}) >= num_layers ({a.num_layers})"),
                hint="at least one layer must be an MoE layer"))
    return out


def _read_side_file(base_dir: FsPath, rel: str, path: Path, what: str) -> tuple[str | None, list[Diagnostic]]:
    try:
        raw = read_input_file(base_dir / rel, MAX_SIDE_FILE_BYTES)
    except InputFileError as exc:
        if exc.missing:
            return None, [Diagnostic(path=path, message=f"{what} '{rel}' does not exist (looked in {base_dir or '.'})",
                                     hint="paths are relative to the spec file's directory")]
        return None, [Diagnostic(path=path, message=f"{what} '{rel}' {exc.why}",
                                 hint="point at a readable UTF-8 text file, relative to the spec file's directory")]
    try:
        return raw.decode("utf-8-sig"), []  # an editor's byte-order mark is not content
    except UnicodeDecodeError as exc:
        return None, [Diagnostic(path=path, message=f"{what} '{rel}' is not UTF-8 text (byte {exc.start})",
                                 hint="point at a readable UTF-8 text file")]


MAX_HISTOGRAM_COUNT = 10**15
"""Most observations one histogram row may count (the sampler's arithmetic is exact below 2**53 in all)."""


def _number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


_ASCII_DIGITS = re.compile(r"([0-9]+)(?:\.0*)?")
"""A whole number in plain digits; ``5.0`` too (pandas writes integer counts so when a column held a NaN)."""


def _unquoted(cell: str) -> str:
    """A cell without the double quotes a CSV writer puts around every field (``csv.QUOTE_ALL``): ``"8"`` is 8."""
    return cell[1:-1].strip() if len(cell) >= 2 and cell[0] == cell[-1] == '"' else cell


def parse_histogram(text: str) -> tuple[list[tuple[int, int]] | None, str]:
    """Parse ``length,count`` rows (a header row and ``#`` comments allowed). Returns (rows, error)."""
    rows: list[tuple[int, int]] = []
    header_seen = False
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cells = [_unquoted(c.strip()) for c in line.replace("\t", ",").split(",")]
        if len(cells) != 2:
            return None, f"line {n}: expected 2 columns `length,count`, got {len(cells)}: {raw.strip()!r}"
        numbers = [m for c in cells if (m := _ASCII_DIGITS.fullmatch(c))]  # int() takes "8_0" and non-ASCII digits
        if len(numbers) != len(cells):
            if not rows and not header_seen and not any(map(_number, cells)):
                header_seen = True
                continue  # a header: the first row, and no cell of it is a number
            return None, f"line {n}: `length,count` must be two whole numbers (digits 0-9), got {raw.strip()!r}"
        length, count = (int(m.group(1)) for m in numbers)
        if length <= 0 or count < 0:
            return None, f"line {n}: length must be > 0 and count >= 0, got {length},{count}"
        if count > MAX_HISTOGRAM_COUNT:
            return None, f"line {n}: count {count} is over {MAX_HISTOGRAM_COUNT:.0e}; scale the counts down"
        rows.append((length, count))
    if not rows or sum(c for _, c in rows) == 0:
        return None, "no observations (no rows with a positive count)"
    return rows, ""


def _lengths(ls: LengthSpec, where: Path, base_dir: FsPath) -> tuple[LengthDistribution | None, Any, list[Diagnostic]]:
    if ls.histogram_file is None:
        assert ls.median_tokens is not None and ls.p99_tokens is not None
        return (LengthDistribution.lognormal(median=ls.median_tokens, p99=ls.p99_tokens, max_tokens=ls.max_tokens,
                                             min_tokens=ls.min_tokens), None, [])
    path = (*where, "histogram_file")
    text, diags = _read_side_file(base_dir, ls.histogram_file, path, "histogram file")
    if text is None:
        return None, None, diags
    rows, err = parse_histogram(text)
    if rows is None:
        return None, None, [Diagnostic(path=path, message=f"histogram '{ls.histogram_file}' is malformed: {err}",
                                       hint="write one `length,count` pair per line")]
    too_long = max(length for length, _ in rows)
    if too_long > ls.max_tokens:
        return None, None, [Diagnostic(path=(*where, "max_tokens"), message=(
            f"histogram '{ls.histogram_file}' has lengths up to {too_long} > max_tokens ({ls.max_tokens})"),
            hint="raise max_tokens to the generation cap the histogram was observed under")]
    if ls.min_tokens > too_long:  # every sample would be raised to min_tokens: the histogram would not matter
        return None, None, [Diagnostic(path=(*where, "min_tokens"), message=(
            f"min_tokens ({ls.min_tokens}) is above every length of histogram '{ls.histogram_file}' (the longest is "
            f"{too_long}): every sample would be {ls.min_tokens} tokens"),
            hint=f"lower min_tokens to at most {too_long}, or remove it")]
    return LengthDistribution.empirical(histogram=rows, max_tokens=ls.max_tokens, min_tokens=ls.min_tokens), rows, []


def _resolve_arch(spec: Spec, base_dir: FsPath) -> tuple[ModelArch | None, Any, list[Diagnostic]]:
    m = spec.model
    if m.preset is not None:
        return get_preset(m.preset), None, []
    if m.architecture is not None:
        diags = _architecture_checks(m.architecture)
        return (None if diags else arch_from_fields(m.architecture, spec.name)), None, diags
    assert m.hf_config is not None
    path: Path = ("model", "hf_config")
    text, diags = _read_side_file(base_dir, m.hf_config, path, "config file")
    if text is None:
        return None, None, diags
    try:
        config = loads_json(text, parse_constant=_NotANumber, parse_float=_float_or_not)
    except json.JSONDecodeError as exc:
        return None, None, [Diagnostic(path=path, message=f"'{m.hf_config}' is not JSON: {exc.msg} at line {exc.lineno}",
                                       hint="point at a Hugging Face config.json")]
    except ValueError as exc:  # nesting too deep, an integer beyond any float, a key given twice
        return None, None, [Diagnostic(path=path, message=f"'{m.hf_config}' is not standard JSON: {exc}",
                                       hint="point at a Hugging Face config.json")]
    if not isinstance(config, dict):
        return None, None, [Diagnostic(path=path, message=f"'{m.hf_config}' must hold a JSON object",
                                       hint="point at a Hugging Face config.json")]
    if (found := _first_not_a_number(config)) is not None:
        key, value = found
        what = (f"{value}, not a JSON number" if value in ("NaN", "Infinity", "-Infinity") else
                f"{value if len(value) <= 24 else value[:12] + '...'}, out of a float's range")
        return None, None, [Diagnostic(path=path, message=f"'{m.hf_config}': key '{key}' is {what}",
                                       hint="write the checkpoint's value as a finite number")]
    try:
        arch = arch_from_hf_config(config, name=_hf_model_name(base_dir, m.hf_config, spec.name))
    except HFConfigError as exc:
        return None, None, [Diagnostic(path=path, message=f"'{m.hf_config}': key '{exc.key}': {exc.reason}",
                                       hint="fix the config file or use model.architecture")]
    quant = config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method != "fp8":
            return None, None, [Diagnostic(path=path, message=(
                f"'{m.hf_config}' quantizes the checkpoint ({repr(method) if isinstance(method, str) else 'an'} "
                "quantization_config): the cost model prices bf16, fp16 or fp8 weights, and the trainer cannot train "
                "quantized ones"), hint="point at the unquantized checkpoint's config.json")]
        if m.dtype != "fp8":
            return None, None, [Diagnostic(path=path, message=(
                f"'{m.hf_config}' quantizes the checkpoint to fp8 (quantization_config), so vLLM would serve fp8 "
                f"weights, but model.dtype is {m.dtype}: the plan would price {m.dtype} ones"),
                hint="set model.dtype: fp8, or point at the unquantized checkpoint's config.json")]
    return arch, config, []


def _hf_model_name(base_dir: FsPath, rel: str, spec_name: str) -> str:
    """The model's name for reports: the folder of a ``config.json`` (a checkpoint's directory), else the file's
    stem (``qwen3-8b.json``); the spec's name where neither names anything (``../config.json`` from the root)."""
    file = FsPath(rel)
    if file.name != "config.json":
        return file.stem or spec_name
    folder = (base_dir / file).resolve().parent.name
    return folder or spec_name


class _NotANumber(str):
    """A config.json value no finite float holds (NaN, Infinity, 1e999), kept as its text so that the key holding
    it can be named (``_first_not_a_number``); Python's reader takes them, transformers' and vLLM's arithmetic
    would carry them into every figure."""


def _float_or_not(text: str) -> float | _NotANumber:
    value = float(text)
    return value if math.isfinite(value) else _NotANumber(text)


def _first_not_a_number(config: Any) -> tuple[str, str] | None:
    """The dotted key (``rope_scaling.short_factor[3]``) and text of the first ``_NotANumber`` in ``config``, in
    the file's order (iterative: a config nested as deeply as the reader allows is walked too)."""
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, _NotANumber):
            return key, str(value)
        if isinstance(value, dict):
            inner = [(f"{key}.{name}" if key else name, v) for name, v in value.items()]
        elif isinstance(value, list):
            inner = [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        stack.extend(reversed(inner))
    return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _hash_and_inputs(spec: Spec, arch: ModelArch, extras: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(spec hash, plan inputs). The hash covers the validated spec, the resolved architecture and the content of
    the files the spec reads (HF config, length histograms); the inputs are the first two as plain JSON and a
    digest of each file's content, which a plan records so that a diff can say which input changed."""
    from dataclasses import asdict

    spec_json, arch_json = spec.model_dump(mode="json"), asdict(arch)
    digest = hashlib.sha256(_canonical({"spec": spec_json, "arch": arch_json, "extras": extras}).encode()).hexdigest()
    files = {name: None if value is None else hashlib.sha256(_canonical(value).encode()).hexdigest()[:16]
             for name, value in sorted(extras.items())}
    inputs = json.loads(_canonical({"spec": spec_json, "arch": arch_json, "files": files}))  # tuples -> lists
    return digest, inputs


def load_spec_text(text: str, file: str, base_dir: FsPath) -> ResolvedSpec:
    doc = parse_yaml(text, file)
    return _resolve(doc, file, base_dir)


def load_spec(file: str, settings: Sequence[tuple[Path, Any]] = ()) -> ResolvedSpec:
    """Read, validate and resolve a spec file; raise ``SpecError`` with every problem found.

    ``settings`` replace fields of the file's document before validation (``dora plan --sweep``), each a (YAML path,
    value): a mapping on the way is created where the path has none (or a scalar, as ``placement: auto``), and the
    lines of the fields kept are the file's."""
    if not file:  # Path("") is ".", the current directory
        raise SpecError(file, [Diagnostic(path=(), message="the file name is empty",
                                          hint="pass the path of a YAML spec file, e.g. specs/local-tiny.yaml")])
    fs = FsPath(file)
    try:
        raw = read_input_file(fs, MAX_FILE_BYTES)
    except InputFileError as exc:
        if exc.missing:
            raise SpecError(file, [Diagnostic(path=(), message="file does not exist",
                                              hint="check the path; example specs live in specs/")]) from None
        raise SpecError(file, [Diagnostic(path=(), message=f"the file {exc.why}",
                                          hint="pass a readable YAML spec file")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(file, [Diagnostic(path=(), message=f"not UTF-8 text (byte {exc.start})",
                                          hint="save the spec as UTF-8 YAML")]) from None
    if not settings:
        return load_spec_text(text, file, fs.parent)
    doc = parse_yaml(text, file)
    data = copy.deepcopy(doc.data)
    for path, value in settings:
        data = _with_value(data, path, value)
    return _resolve(dataclasses.replace(doc, data=data), file, fs.parent)


def _with_value(data: Any, path: Path, value: Any) -> Any:
    """``data`` with the field at ``path`` set to ``value`` (mappings on the way created; ``data`` is changed)."""
    if not path:
        return value
    out = data if isinstance(data, dict) else {}
    out[path[0]] = _with_value(out.get(path[0]), path[1:], value)
    return out


def _section_checks(data: Any, reported: set[Path]) -> list[Diagnostic]:
    """When the whole spec fails validation, still run the checks of the sections that validate alone,
    so one round trip shows every problem."""
    out: list[Diagnostic] = []
    if not isinstance(data, dict):
        return out
    workload = data.get("workload")
    if not isinstance(workload, dict):
        workload = {}
    for which in ("prompt_length", "response_length"):
        try:
            length = LengthSpec.model_validate(workload.get(which))
        except ValidationError:
            continue
        out += check_lengths(length, ("workload", which))
    try:
        out += check_spec_staleness(StalenessSpec.model_validate(data.get("staleness", {})))
    except ValidationError:
        pass
    return [d for d in out if d.path not in reported]


def _with_keys_meant(data: Any, stray: list[Path]) -> tuple[Spec, dict[Path, Path]] | None:
    """The spec ``data`` is once each key at ``stray``, which names no field, is read as the field it is closest to
    (the did-you-mean of its diagnostic), or left out where that field is set too, and the renamed paths (meant ->
    written); None when a stray key is close to no field, or the spec is still not valid. Checked that way, the other
    problems are the ones the spec has once the typo is fixed: with the key left out instead, its field's default
    would be judged (a typo of `rollout_engine` on a CPU spec was reported as vllm needing a GPU, with advice to
    remove the task)."""
    data = copy.deepcopy(data)
    renamed: dict[Path, Path] = {}
    for path in stray:
        mapping = data
        for part in path[:-1]:
            mapping = mapping.get(part) if isinstance(mapping, dict) else None
        meant = closest_field(path)
        if not isinstance(mapping, dict) or path[-1] not in mapping or meant is None:
            return None
        value = mapping.pop(path[-1])
        if meant not in mapping:
            mapping[meant] = value
            renamed[(*path[:-1], meant)] = path
    try:
        return Spec.model_validate(data), renamed
    except ValidationError:
        return None


MODEL_SOURCES = ("preset", "hf_config", "architecture")


def _one_model_source(data: Any, diags: list[Diagnostic]) -> list[Diagnostic]:
    """``diags`` of a spec whose model gives several sources: what validation says inside them is moot until one is
    chosen (an empty ``architecture: {}`` beside an hf_config read as five missing fields), so it is replaced by that
    (``check_spec`` says it of a spec that validates)."""
    model = data.get("model") if isinstance(data, dict) else None
    sources = [k for k in MODEL_SOURCES if isinstance(model, dict) and model.get(k) is not None]
    if len(sources) < 2:
        return diags
    kept = [d for d in diags if not any(d.path[:2] == ("model", k) for k in sources)]
    return [Diagnostic(path=("model",), message=f"give exactly one model source, got {' and '.join(sources)}",
                       hint="set one of model.preset, model.hf_config or model.architecture"), *kept]


def _resolve(doc: YamlDoc, file: str, base_dir: FsPath) -> ResolvedSpec:
    renamed: dict[Path, Path] = {}  # a field read from a misspelt key (meant -> written): its line is the key's

    def line_of(path: Path) -> int | None:
        for meant, written in renamed.items():
            if path[:len(meant)] == meant:
                return doc.line_of((*written, *path[len(meant):]))
        return doc.line_of(path)

    def located(diags: list[Diagnostic]) -> list[Diagnostic]:
        return [Diagnostic(path=d.path, message=d.message, hint=d.hint, file=d.file or file,
                           line=d.line if d.line is not None else line_of(d.path)) for d in diags]

    data = doc.data
    if isinstance(data, dict) and "format_version" in data and "spec_hash" in data:  # `dora plan --out`'s plan.json
        raise SpecError(file, [Diagnostic(path=(), message="this is a dora plan file, not a spec",
                                          hint=f"pass the spec it was planned from ({data.get('spec_file', '?')})",
                                          file=file)])
    # a scalar YAML could not build (`!!int "abc"`) is in the data as its text: its own diagnostic replaces what
    # validation says about that text
    diags = located(list(doc.problems))
    stray: list[Path] = []
    try:
        spec = Spec.model_validate(doc.data)
    except ValidationError as exc:
        diags += diagnostics_from_validation(exc, doc, file, [d.path for d in diags])
        diags = located(_one_model_source(doc.data, diags))
        # when misspelt keys are all that validation refused, the spec with each read as the field it is closest to
        # is checked too, so that a typo does not hide every other problem until it is fixed
        stray = stray_keys(exc) or []
        meant = _with_keys_meant(doc.data, stray) if stray else None
        if meant is None:
            raise SpecError(file, diags + located(_section_checks(doc.data, {d.path for d in diags}))) from None
        spec, renamed = meant
    diags += check_spec(spec)
    arch, hf, arch_diags = (None, None, []) if any(d.path[:1] == ("model",) and d.path not in stray for d in diags) \
        else _resolve_arch(spec, base_dir)
    diags += arch_diags
    length_diags = [d for d in diags if d.path[:2] in (("workload", "prompt_length"), ("workload", "response_length"))]
    prompt = response = None
    extras: dict[str, Any] = {"hf_config": hf}
    if not length_diags:
        prompt, extras["prompt_histogram"], d1 = _lengths(spec.workload.prompt_length, ("workload", "prompt_length"),
                                                          base_dir)
        response, extras["response_histogram"], d2 = _lengths(spec.workload.response_length,
                                                               ("workload", "response_length"), base_dir)
        diags += d1 + d2
    if arch is not None:
        diags += check_context(spec, arch) + check_placement(spec, arch)
    if diags:
        raise SpecError(file, located(diags))
    assert arch is not None and prompt is not None and response is not None
    if not all(math.isfinite(x) for x in (prompt.mean_tokens(), response.mean_tokens())):
        raise SpecError(file, located([Diagnostic(path=("workload",), message="length distribution is degenerate",
                                                  hint="check median/p99/max")]))
    spec_hash, inputs = _hash_and_inputs(spec, arch, extras)
    return ResolvedSpec(spec=spec, arch=arch, prompt_lengths=prompt, response_lengths=response, file=file,
                        spec_hash=spec_hash, inputs=inputs)
