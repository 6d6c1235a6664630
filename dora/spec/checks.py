"""Cross-field rules of a spec, each reported at its own YAML path with the arithmetic and a fix.

``check_spec`` needs only the validated ``Spec``; ``check_placement`` also needs the resolved architecture
(heads, layers, experts) because divisibility depends on it.
"""

from __future__ import annotations

import math
import re
import unicodedata
import urllib.parse

from dora.runtime.vllm_cpu import VLLM_CPU_HEAD_DIMS
from dora.spec.diagnostics import Diagnostic
from dora.spec.models import LengthSpec, Spec, StalenessSpec
from planner.architecture import MODEL_PRESETS, ModelArch
from planner.search.core import MAX_ACCELERATORS, MAX_BATCH_SAMPLES, MAX_CPU_CORES
from planner.train_cost import pipeline_stage_layers


def _d(path: tuple[str | int, ...], message: str, hint: str) -> Diagnostic:
    return Diagnostic(path=path, message=message, hint=hint)


DASHBOARD_PORT = 8265
"""Ray's default dashboard (and Jobs API) port."""
ADDRESS_FORMS = "http://HEAD:8265 (the Ray dashboard), ray://HEAD:10001 (Ray Client), HEAD:6379 (the GCS) or auto"
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")  # underscores: Docker service names
_IPV6 = re.compile(r"[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*")


def _host_ok(host: str) -> bool:
    """A host name, an IPv4 address, or an IPv6 address (bracketed, as it stands before a port)."""
    if host.startswith("[") and host.endswith("]"):
        return bool(_IPV6.fullmatch(host[1:-1]))
    return bool(_HOSTNAME.fullmatch(host))


def address_problem(address: str) -> str | None:
    """Why ``address`` names no Ray cluster that dora can submit a job to, or None.

    The forms Ray's Jobs client reads: ``http(s)://HOST[:PORT]``, ``ray://HOST[:PORT]``, ``HOST:PORT`` (a GCS address,
    asked for the dashboard's URL) and ``auto`` (the cluster this machine runs). Ray takes any other scheme for the name
    of a plugin module to import, and anything else without one for a GCS address, which it waits ~40 s on."""
    if not address.strip():
        return "is empty"
    if any(c.isspace() or not c.isprintable() for c in address):
        return "contains spaces or control characters (a URL writes them %-escaped)"
    if address == "auto":
        return None
    if "://" in address:
        scheme = address.split("://", 1)[0]
        if scheme not in ("http", "https", "ray"):
            return f"has scheme {scheme}://; dora submits over http://, https:// or ray://"
        try:
            parts = urllib.parse.urlsplit(address)
            parts.port  # noqa: B018 - reading it checks it: a port that is not a number in 0..65535 raises
        except ValueError as exc:
            return f"is not a valid URL ({exc})"
        host = parts.hostname
        if not host or not _host_ok(f"[{host}]" if ":" in host else host):
            return "names no host"
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not _host_ok(host):
        return "is neither a URL nor HOST:PORT"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"has port {port!r}, not a number in 1..65535"
    if int(port) == DASHBOARD_PORT:
        return f"is read as a GCS address without http://, but {DASHBOARD_PORT} is the dashboard's port"
    return None


def path_problem(path: tuple[str | int, ...], value: str | None) -> list[Diagnostic]:
    """A file path field that is empty once invisible characters are set aside (it would name the spec's own
    directory), holds a NUL byte, which no operating system takes (Python's open raises ValueError), or holds another
    character ``unprintable`` names (messages would print it raw)."""
    if value is not None and not "".join(ch for ch in value if not unprintable(ch)).strip():
        return [_d(path, f"the path is empty ({value!r})", "name a path, or leave the key out")]
    if value is not None and "\0" not in value and (bad := unprintable(value)):
        return [_d(path, f"{value!r} holds the unprintable character {bad}", "remove it from the path")]
    if value is None or "\0" not in value:
        return []
    return [_d(path, f"{value!r} contains a NUL byte (\\0), which no file path can hold",
               "remove the \\0 from the path (in double quotes YAML reads \"\\0\" as a NUL byte)")]


def check_lengths(length: LengthSpec, where: tuple[str, ...]) -> list[Diagnostic]:
    out = path_problem((*where, "histogram_file"), length.histogram_file)
    lognormal = length.median_tokens is not None or length.p99_tokens is not None
    if lognormal and length.histogram_file is not None:
        out.append(_d((*where, "histogram_file"), "give either median_tokens/p99_tokens or histogram_file, not both",
                      "remove histogram_file to use the lognormal, or remove median_tokens and p99_tokens"))
    elif not lognormal and length.histogram_file is None:
        out.append(_d(where, "no distribution given",
                      "add median_tokens and p99_tokens (lognormal), or histogram_file"))
    elif lognormal:
        if length.median_tokens is None or length.p99_tokens is None:
            missing = "median_tokens" if length.median_tokens is None else "p99_tokens"
            out.append(_d((*where, missing), "a lognormal length needs both median_tokens and p99_tokens",
                          f"add `{missing}:`"))
        else:
            med, p99 = length.median_tokens, length.p99_tokens
            if p99 < med:
                out.append(_d((*where, "p99_tokens"), f"p99_tokens ({p99}) < median_tokens ({med})",
                              "the 99th percentile cannot be below the median; raise p99_tokens"))
            if length.max_tokens < med:
                out.append(_d((*where, "max_tokens"), f"max_tokens ({length.max_tokens}) < median_tokens ({med})",
                              "raise max_tokens (the generation cap) above the median length"))
            if length.min_tokens > med:
                out.append(_d((*where, "min_tokens"), f"min_tokens ({length.min_tokens}) > median_tokens ({med})",
                              "lower min_tokens"))
    if length.min_tokens > length.max_tokens:
        out.append(_d((*where, "min_tokens"), f"min_tokens ({length.min_tokens}) > max_tokens ({length.max_tokens})",
                      "lower min_tokens or raise max_tokens"))
    return out


_ALLOWED_FORMAT = frozenset("\u200c\u200d\u200e\u200f\u061c")
"""Format characters that text in some scripts needs and that change nothing around them: the zero-width non-joiner
and joiner (Persian, Indic scripts, emoji sequences), and the left-to-right, right-to-left and Arabic letter marks.
Tag characters (U+E0020-E007F, which spell the flags of Scotland, England and Wales) are allowed too."""


def unprintable(text: str) -> str | None:
    """The first character of ``text`` a terminal would not show as itself, as ``U+XXXX``; None if there is none: a
    control character (a newline, an escape sequence's ESC), a line or paragraph separator, a lone surrogate, or an
    invisible format character (a bidirectional override or isolate, a zero-width space, a byte-order mark).
    Unassigned and private-use code points pass: Python's character database lags the emoji terminals show."""
    for ch in text:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cs", "Zl", "Zp") or (
                cat == "Cf" and ch not in _ALLOWED_FORMAT and not "\U000e0020" <= ch <= "\U000e007f"):
            return f"U+{ord(ch):04X}"
    return None


def check_spec(spec: Spec) -> list[Diagnostic]:
    """Rules that need the whole spec but not the resolved architecture."""
    out: list[Diagnostic] = []
    bad = unprintable(spec.name)
    if bad:
        out.append(_d(("name",), f"contains the unprintable character {bad}, which dora would print to terminals and "
                                 "logs as it is", "use letters, digits, spaces and punctuation"))
    m = spec.model
    sources = [k for k in ("preset", "hf_config", "architecture") if getattr(m, k) is not None]
    if len(sources) != 1:
        msg = "no model given" if not sources else f"give exactly one model source, got {' and '.join(sources)}"
        out.append(_d(("model",), msg, "set one of model.preset, model.hf_config or model.architecture"))
    out += path_problem(("model", "hf_config"), m.hf_config) + path_problem(("model", "checkpoint"), m.checkpoint)
    out += check_lengths(spec.workload.prompt_length, ("workload", "prompt_length"))
    out += check_lengths(spec.workload.response_length, ("workload", "response_length"))
    c = spec.cluster
    if c.nodes * c.accelerators_per_node > MAX_ACCELERATORS:
        out.append(_d(("cluster", "nodes"),
                      f"nodes x accelerators_per_node = {c.nodes:,} x {c.accelerators_per_node} = "
                      f"{c.nodes * c.accelerators_per_node:,} accelerators; dora plans clusters of up to "
                      f"{MAX_ACCELERATORS:,} (its planner simulates every rollout replica)",
                      "lower cluster.nodes"))
    elif c.accelerator == "cpu" and c.nodes * c.accelerators_per_node > MAX_CPU_CORES:
        field = "nodes" if c.nodes > 1 else "accelerators_per_node"
        out.append(_d(("cluster", field),
                      f"nodes x accelerators_per_node = {c.nodes:,} x {c.accelerators_per_node:,} = "
                      f"{c.nodes * c.accelerators_per_node:,} cpu cores; the cpu accelerator is dora's embedded "
                      f"runtime on one host, planned up to {MAX_CPU_CORES:,} cores",
                      f"lower cluster.{field} (one node with the host's cores is what the cpu runtime uses)"))
    w = spec.workload
    if w.prompts_per_step * w.samples_per_prompt > MAX_BATCH_SAMPLES:
        out.append(_d(("workload", "prompts_per_step"),
                      f"prompts_per_step x samples_per_prompt = {w.prompts_per_step:,} x {w.samples_per_prompt} = "
                      f"{w.prompts_per_step * w.samples_per_prompt:,} trajectories per step; dora plans batches of "
                      f"up to {MAX_BATCH_SAMPLES:,} (its planner simulates each candidate's steps)",
                      "lower prompts_per_step or samples_per_prompt (specs/moe-scale-x10240.yaml, the largest "
                      "example, has 4,096 x 16)"))
    batch, minibatches = w.prompts_per_step * w.samples_per_prompt, spec.algorithm.minibatches_per_step
    if batch % minibatches:
        fits = [d for d in range(2, min(batch, 64) + 1) if batch % d == 0][:6]
        out.append(_d(("algorithm", "minibatches_per_step"),
                      f"a step's {batch:,} samples (prompts_per_step x samples_per_prompt) do not split into "
                      f"{minibatches} equal minibatches ({batch:,} / {minibatches} = {batch / minibatches:,.2f}); "
                      "Megatron's global batch is one minibatch and must be whole",
                      f"choose a divisor of {batch:,}" + (f" ({', '.join(map(str, fits))}, ...)" if fits else "")
                      + ", or change the batch"))

    if spec.algorithm.name == "grpo" and w.samples_per_prompt < 2:
        out.append(_d(("workload", "samples_per_prompt"),
                      "grpo measures each reward against the others of its prompt group: with one sample per prompt "
                      "every advantage is 0 and nothing is learnt",
                      "set samples_per_prompt to 2 or more (8-16 is usual), or algorithm.name: ppo"))
    out += check_spec_staleness(spec.staleness)
    out += _runtime_checks(spec)
    return out


def check_spec_staleness(st: StalenessSpec) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    k = st.max_version_lag
    if st.mode == "partial-rollout" and not st.allow_version_mixing:
        out.append(_d(("staleness", "mode"), "partial-rollout resumes trajectories on new weights, which mixes "
                      "policy versions inside a trajectory",
                      "set staleness.allow_version_mixing: true, or choose mode streaming (no mixing)"))
    if st.mode in ("one-step-off", "bounded-async", "partial-rollout", "streaming") and k == 0:
        out.append(_d(("staleness", "max_version_lag"), f"mode {st.mode} needs a staleness budget k >= 1, got k = 0",
                      "k = 0 is synchronous on-policy training: set mode: sync, or max_version_lag >= 1"))
    if st.mode == "one-step-off" and k > 1:
        out.append(_d(("staleness", "max_version_lag"), f"one-step-off uses exactly one step of staleness, got k = {k}",
                      "set max_version_lag: 1, or choose bounded-async / streaming to use a larger budget"))
    return out


def _runtime_checks(spec: Spec) -> list[Diagnostic]:
    out: list[Diagnostic] = []

    rt = spec.runtime
    out += path_problem(("runtime", "output_dir"), rt.output_dir)
    cpu = spec.cluster.accelerator == "cpu"
    if rt.backend == "ray-cluster" and not rt.address:
        out.append(_d(("runtime", "address"), "backend ray-cluster needs the cluster's address",
                      "set runtime.address: http://<head>:8265 (the Ray dashboard)"))
    elif rt.backend == "local" and rt.address is not None:  # `dora apply` reads it only to submit to a cluster
        out.append(_d(("runtime", "address"), "runtime.address is only used with backend: ray-cluster, and backend "
                      "is local (a Ray instance on this machine)",
                      "remove it or set backend: ray-cluster"))
    elif rt.address is not None and (problem := address_problem(rt.address)):
        out.append(_d(("runtime", "address"), f"{rt.address!r} {problem}", f"write it as {ADDRESS_FORMS}"))
    if cpu and rt.rollout_engine == "vllm":  # vLLM's CPU backend (dora.runtime.engines.vllm_rollout)
        head_dim, where = _head_dim(spec)
        if head_dim is not None and head_dim not in VLLM_CPU_HEAD_DIMS:
            out.append(_d(where, f"vLLM's CPU attention takes a head_dim of {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}"
                          f", and the model's is {head_dim}", "give model.architecture a head_dim vLLM takes (`dora "
                          "examples local-tiny-vllm` has one), or set runtime.rollout_engine: torch"))
        pinned = spec.placement.rollout.versions_per_engine if spec.placement != "auto" else None
        if pinned is not None and pinned > 1:
            out.append(_d(("placement", "rollout", "versions_per_engine"), f"a vLLM engine hosts one policy "
                          f"version, got {pinned}", "set it to 1 or remove it, or set runtime.rollout_engine: torch"))
    # trainer: megatron on cpu is the rehearsal of the Megatron path: megatron-core trains (fp32), torch engines roll out
    for field, gpu_name in (("rollout_engine", "vllm"), ("trainer", "megatron")):
        if not cpu and getattr(rt, field) == "torch":
            out.append(_d(("runtime", field), f"the torch {field.replace('_', ' ')} runs on the cpu accelerator only, "
                          f"but cluster.accelerator is {spec.cluster.accelerator}",
                          f"set runtime.{field}: {gpu_name}"))
    embedded = cpu  # the embedded runtime: torch or vLLM engines, torch or Megatron trainer
    if embedded and spec.workload.task is None:
        out.append(_d(("workload", "task"), "the embedded CPU runtime needs a task to train on",
                      "add `task: {name: count}` under workload"))
    if spec.workload.task is not None and not embedded:
        out.append(_d(("workload", "task"), "workload.task is only used by the embedded CPU runtime",
                      "remove workload.task (GPU runs read prompts from their own dataset)"))
    if embedded and spec.workload.task is not None:
        out += check_task_lengths(spec)
    if embedded and spec.model.dtype != "fp32":  # the torch engines and trainers, megatron-core's too, run fp32
        default = "" if "dtype" in spec.model.model_fields_set else " (the default)"
        out.append(_d(("model", "dtype"), f"the embedded CPU runtime computes in fp32, but model.dtype is "
                      f"{spec.model.dtype}{default}: the plan would price {spec.model.dtype} weights and activations "
                      "that the run does not use", "set model.dtype: fp32"))
    if embedded and spec.algorithm.name != "grpo":
        out.append(_d(("algorithm", "name"), f"the embedded CPU runtime trains grpo only, got {spec.algorithm.name}",
                      "set algorithm.name: grpo"))
    if spec.objective == "cost" and spec.cluster.price_per_accelerator_hour_usd is None:
        out.append(_d(("objective",), "objective cost needs a price",
                      "set cluster.price_per_accelerator_hour_usd, or objective: throughput"))
    return out


def _head_dim(spec: Spec) -> tuple[int | None, tuple[str, ...]]:
    """The model's head size, as the spec gives it (a preset's or an explicit architecture's; None for a Hugging Face
    config, which the resolution reads), and the field it comes from."""
    m = spec.model
    if m.preset is not None and m.preset in MODEL_PRESETS:
        return MODEL_PRESETS[m.preset].head_dim, ("model", "preset")
    a = m.architecture
    if a is None:
        return None, ("model",)
    if a.head_dim is not None:
        return a.head_dim, ("model", "architecture", "head_dim")
    return a.hidden_size // a.num_attention_heads, ("model", "architecture", "hidden_size")


def check_task_lengths(spec: Spec) -> list[Diagnostic]:
    """The lengths of the embedded runtime's task against what it generates (``dora.runtime.tasks``): its prompts are
    always ``PROMPT_TOKENS`` long, so ``workload.prompt_length`` must say exactly that (the plan `dora apply` prints
    is of the spec's workload: another prompt length plans another run); its shortest answer is one number and EOS,
    so ``workload.response_length.max_tokens`` must leave room for it."""
    from dora.runtime.tasks import MIN_RESPONSE_TOKENS, PROMPT_TOKENS

    out: list[Diagnostic] = []
    w = spec.workload
    task = w.task.name if w.task is not None else "count"
    response_cap = w.response_length.max_tokens
    if response_cap < MIN_RESPONSE_TOKENS:
        out.append(_d(("workload", "response_length", "max_tokens"),
                      f"max_tokens ({response_cap}) leaves no room for an answer of the {task} task, whose "
                      f"shortest is {MIN_RESPONSE_TOKENS} tokens (one number and EOS)",
                      f"set workload.response_length.max_tokens to at least {MIN_RESPONSE_TOKENS}"))
    where, p = ("workload", "prompt_length"), w.prompt_length
    fixed = f"{{median_tokens: {PROMPT_TOKENS}, p99_tokens: {PROMPT_TOKENS}, max_tokens: {PROMPT_TOKENS}}}"
    said = f"the {task} task's prompts are always {PROMPT_TOKENS} tokens ([BOS, a, b, SEP])"
    if p.histogram_file is not None:
        out.append(_d((*where, "histogram_file"), f"{said}, not lengths from a histogram: the plan would be of "
                      "another workload", f"write prompt_length: {fixed} instead of histogram_file"))
        return out
    for field in ("median_tokens", "p99_tokens", "max_tokens"):
        value = getattr(p, field)
        if value is not None and value != PROMPT_TOKENS:
            out.append(_d((*where, field), f"{field} is {value:,}, but {said}: the plan `dora apply` prints would be "
                          f"of another workload", f"set {field}: {PROMPT_TOKENS} (prompt_length: {fixed})"))
    return out


def check_context(spec: Spec, arch: ModelArch) -> list[Diagnostic]:
    """The longest sequence, prompt cap + response cap, within the checkpoint's context (vLLM refuses a longer
    ``max_model_len``). Reported at the response cap, or at the prompt cap when it alone leaves no room for a
    response."""
    limit, w = arch.max_context_tokens, spec.workload
    prompt, response = w.prompt_length.max_tokens, w.response_length.max_tokens
    longest = prompt + response
    if limit is None or longest <= limit:
        return []
    context = "max_position_embeddings" + (" with its RoPE scaling" if arch.rope_scaling else "")
    if limit < 2:  # no caps fit: the config is what is wrong
        return [_d(("model", "hf_config"), f"the model's context of {limit:,} token ({context}) holds no prompt and "
                   "response (at least one token each)", "check max_position_embeddings in the config.json")]
    message = (f"prompt max ({prompt:,}) + response max ({response:,}) = {longest:,} tokens exceeds the model's "
               f"context of {limit:,} ({context})")
    longer = ("give model.hf_config a config.json whose rope_scaling extends the context" if not arch.rope_scaling
              else "use a model with a longer context")
    if prompt < limit:
        return [_d(("workload", "response_length", "max_tokens"), message,
                   f"lower it to at most {limit - prompt:,}, lower workload.prompt_length.max_tokens, or {longer}")]
    room = (f"lower it to at most {limit - response:,} (keeping the response cap)" if response < limit
            else f"lower it and workload.response_length.max_tokens to add up to at most {limit:,}")
    return [_d(("workload", "prompt_length", "max_tokens"), f"{message}; the prompt cap alone leaves no room for a "
               "response", f"{room}, or {longer}")]


def check_placement(spec: Spec, arch: ModelArch) -> list[Diagnostic]:
    """Pinned placement against the cluster size and the model's heads, layers and experts."""
    out: list[Diagnostic] = []
    if spec.placement == "auto":
        return out
    total = spec.total_accelerators
    p = spec.placement
    r, t = p.rollout, p.train
    moe = arch.num_experts > 0
    R, T = ("placement", "rollout"), ("placement", "train")

    def divides(path, what: str, size: int, of_what: str, of: int, hint: str) -> None:
        if of % size:
            out.append(_d(path, f"{what} ({size}) does not divide {of_what} ({of}): {of} % {size} = {of % size}", hint))

    if r.tp is not None:
        divides((*R, "tp"), "rollout tp", r.tp, "num_attention_heads", arch.num_attention_heads,
                "choose a tp that divides the model's attention heads")
        if not arch.tp_shards_kv_heads(r.tp):
            out.append(_d((*R, "tp"), f"rollout tp ({r.tp}) neither divides nor is a multiple of num_kv_heads "
                          f"({arch.num_kv_heads}): vLLM gives each tensor-parallel rank whole KV heads, or replicates "
                          "each head over whole ranks", "choose a tp that divides num_kv_heads, or a multiple of it"))
    if r.ep is not None:
        if not moe:
            out.append(_d((*R, "ep"), "expert parallelism needs an MoE model; this model is dense",
                          "remove placement.rollout.ep"))
        else:
            divides((*R, "ep"), "rollout ep", r.ep, "num_experts", arch.num_experts, "choose an ep dividing the experts")
            if r.tp is not None and r.ep > 1 and r.ep % r.tp:
                out.append(_d((*R, "ep"), f"rollout ep ({r.ep}) must be a multiple of tp ({r.tp}): an engine replica "
                              f"spans ep = tp x attention-dp accelerators, and {r.ep} % {r.tp} = {r.ep % r.tp}",
                              "set ep to tp times the attention data-parallel size"))
            elif r.tp is not None and r.ep > r.tp > spec.cluster.accelerators_per_node:
                out.append(_d((*R, "tp"), f"rollout ep ({r.ep}) over tp ({r.tp}) pins attention data-parallel ranks "
                              f"of {r.tp} accelerators, more than a node's {spec.cluster.accelerators_per_node}: dora "
                              "plans such ranks within one node", f"pin tp {spec.cluster.accelerators_per_node} or "
                              f"less, or ep {r.tp} (no attention data parallelism)"))
    replica = max(r.tp or 1, r.ep or 1)
    # each side gets the whole cluster when colocated (or maybe colocated), at most all but one accelerator otherwise
    room = total - 1 if p.colocated is False else total
    where = f"the cluster's {total} accelerators" + (" less one for the other side" if p.colocated is False else "")
    if room < 1:
        out.append(_d(("placement", "colocated"), f"a disaggregated placement needs one accelerator for rollout and "
                      f"one for training; the cluster has {total}",
                      "set placement.colocated: true (or remove it), or add accelerators"))
    elif replica > room:
        field = "ep" if (r.ep or 1) > (r.tp or 1) else "tp"
        out.append(_d((*R, field), f"one engine replica spans {field} = {replica} accelerators, more than {where}",
                      f"use a {field} of at most {room}, or add accelerators"))
    w = spec.workload
    batch, minibatches = w.prompts_per_step * w.samples_per_prompt, spec.algorithm.minibatches_per_step
    if t.dp is not None and batch % minibatches == 0:
        divides((*T, "dp"), "train dp", t.dp, "the samples of an optimizer step (prompts_per_step x "
                "samples_per_prompt / minibatches_per_step)", batch // minibatches,
                "Megatron splits each minibatch evenly over the data-parallel ranks: choose a dp dividing it")
    pinned = [(name, size) for name, size in (("tp", t.tp), ("pp", t.pp), ("dp", t.dp), ("cp", t.cp))
              if size is not None]
    needs = math.prod(size for _, size in pinned)
    if pinned and needs > room >= 1:
        field = max(pinned, key=lambda item: item[1])[0]
        product = " x ".join(name for name, _ in pinned)
        sizes = " x ".join(str(size) for _, size in pinned)
        out.append(_d((*T, field), f"the pinned training layout needs at least {product} = "
                      + (f"{sizes} = " if len(pinned) > 1 else "") + f"{needs:,} accelerators, more than {where}",
                      f"lower {field} (or the other pinned sizes), or add accelerators"))
    if r.accelerators is not None:
        if r.accelerators > total:
            out.append(_d((*R, "accelerators"), f"rollout accelerators ({r.accelerators}) exceed the cluster "
                          f"({spec.cluster.nodes} nodes x {spec.cluster.accelerators_per_node} = {total})",
                          f"use at most {total}"))
        divides((*R, "accelerators"), "engine replica size", replica, "rollout accelerators", r.accelerators,
                "make rollout accelerators a multiple of the replica size (tp, or ep for MoE)")

    if t.tp is not None:
        divides((*T, "tp"), "train tp", t.tp, "num_attention_heads", arch.num_attention_heads,
                "choose a tp that divides the attention heads")
        if arch.mla is None:
            divides((*T, "tp"), "train tp", t.tp, "num_kv_heads", arch.num_kv_heads,
                    "Megatron shards KV groups over tp: choose a tp that divides num_kv_heads")
    if t.pp is not None and pipeline_stage_layers(arch.num_layers, t.pp) is None:
        m = -(-arch.num_layers // t.pp)
        out.append(_d((*T, "pp"), f"train pp ({t.pp}) cannot split {arch.num_layers} layers: Megatron gives every "
                      f"middle stage the same count ({m} = ceil({arch.num_layers}/{t.pp}) here) and the first and "
                      f"last stages the rest ({arch.num_layers} - {t.pp - 2}*{m} = "
                      f"{arch.num_layers - (t.pp - 2) * m}), and each needs at least one layer",
                      "choose a smaller pp, or one that divides the number of layers"))
    if t.ep is not None:
        if not moe:
            out.append(_d((*T, "ep"), "expert parallelism needs an MoE model; this model is dense",
                          "remove placement.train.ep"))
        else:
            divides((*T, "ep"), "train ep", t.ep, "num_experts", arch.num_experts, "choose an ep dividing the experts")
    dims = {"tp": t.tp, "pp": t.pp, "dp": t.dp, "cp": t.cp}
    if t.accelerators is not None and all(v is not None for v in dims.values()):
        prod = t.tp * t.pp * t.dp * t.cp  # type: ignore[operator]
        if prod != t.accelerators:
            out.append(_d((*T, "accelerators"), f"tp({t.tp}) * pp({t.pp}) * dp({t.dp}) * cp({t.cp}) = {prod} "
                          f"!= train accelerators ({t.accelerators})",
                          "make the product of the parallel sizes equal the train accelerators"))
        if t.ep is not None and (t.tp * t.dp * t.cp) % t.ep:  # type: ignore[operator]
            out.append(_d((*T, "ep"), f"train ep ({t.ep}) must divide tp*dp*cp = {t.tp * t.dp * t.cp}",  # type: ignore[operator]
                          "expert-parallel ranks are carved out of the tp x dp x cp ranks; lower ep"))
    if t.accelerators is not None and t.accelerators > total:
        out.append(_d((*T, "accelerators"), f"train accelerators ({t.accelerators}) exceed the cluster ({total})",
                      f"use at most {total}"))
    if p.colocated is True:
        for path, n in (((*R, "accelerators"), r.accelerators), ((*T, "accelerators"), t.accelerators)):
            if n is not None and n != total:
                out.append(_d(path, f"colocated placement time-shares all {total} accelerators, got {n}",
                              f"remove it or set it to {total}"))
    elif p.colocated is False and r.accelerators == total:
        out.append(_d((*R, "accelerators"), f"a disaggregated placement needs accelerators for training, and rollout "
                      f"takes all {total}", f"use at most {total - 1}, or set placement.colocated: true to time-share"))
    elif p.colocated is False and t.accelerators == total:
        out.append(_d((*T, "accelerators"), f"a disaggregated placement needs accelerators for rollout, and training "
                      f"takes all {total}", f"use at most {total - 1}, or set placement.colocated: true to time-share"))
    elif r.accelerators is not None and t.accelerators is not None and r.accelerators + t.accelerators > total:
        out.append(_d((*R, "accelerators"), f"rollout ({r.accelerators}) + train ({t.accelerators}) = "
                      f"{r.accelerators + t.accelerators} > cluster ({total})",
                      "shrink one side, or set placement.colocated: true to time-share"))
    if r.consolidation_batch is not None and spec.staleness.mode not in ("auto", "streaming"):
        out.append(_d((*R, "consolidation_batch"), f"consolidation only happens in mode streaming, and "
                      f"staleness.mode is {spec.staleness.mode!r}",
                      "remove consolidation_batch or set staleness.mode to streaming or auto"))
    elif r.consolidation_batch is not None and spec.staleness.mode == "auto" and spec.staleness.max_version_lag == 0:
        out.append(_d((*R, "consolidation_batch"), "consolidation only happens in mode streaming, which needs a "
                      "staleness budget k >= 1, and staleness.max_version_lag is 0 (mode auto can only pick sync)",
                      "remove consolidation_batch, or raise staleness.max_version_lag to 1 or more"))
    if r.max_num_seqs is not None and r.max_num_seqs < spec.workload.samples_per_prompt:
        out.append(_d((*R, "max_num_seqs"), f"an engine runs a prompt group's {spec.workload.samples_per_prompt} "
                      f"samples (workload.samples_per_prompt) side by side, and max_num_seqs is {r.max_num_seqs}",
                      f"set max_num_seqs to {spec.workload.samples_per_prompt} or more, or remove it"))
    if spec.cluster.accelerator == "cpu" and r.tp is not None and r.tp > 1:
        out.append(_d((*R, "tp"), f"the CPU engine runs one thread per replica, so rollout tp must be 1, got {r.tp}",
                      "set tp: 1 (or remove it); more rollout replicas use more cores"))
    if (r.versions_per_engine is not None and r.versions_per_engine > 1
            and spec.staleness.mode not in ("auto", "streaming")):
        out.append(_d((*R, "versions_per_engine"), f"only mode streaming hosts several versions per engine, and "
                      f"staleness.mode is {spec.staleness.mode!r}",
                      "remove versions_per_engine (or set it to 1), or set staleness.mode to streaming or auto"))
    elif r.versions_per_engine is not None and r.versions_per_engine > spec.staleness.max_version_lag + 1:
        out.append(_d((*R, "versions_per_engine"), f"an engine can hold at most k+1 = "
                      f"{spec.staleness.max_version_lag + 1} live versions, got {r.versions_per_engine}",
                      "lower versions_per_engine or raise staleness.max_version_lag"))
    return out
