"""Accelerator catalog: the peak rates the cost model divides by.

Every entry stores *dense* (no structured-sparsity) BF16 peak FLOP/s, the device memory a framework can actually
allocate, peak HBM bandwidth, scale-up bandwidth (NVLink / xGMI), scale-out bandwidth (NIC) and the host link (PCIe)
per accelerator.

Units: FLOP/s, bytes, bytes/s.  Link bandwidths are **per accelerator, one direction** (a data sheet's
"900 GB/s NVLink" is the bidirectional sum, so 450e9 here).  NIC figures are line rate / 8 (400 Gb/s -> 50e9 B/s).
Achieved fractions of these peaks are calibration factors (`planner.calibration`), not catalog values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

_GIB = 1024**3
_MIB = 1024**2


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One accelerator model.  See the module docstring for units and conventions."""

    name: str
    """Catalog key."""
    description: str
    bf16_flops: float
    """Dense BF16 peak, FLOP/s (data-sheet "with sparsity" figures halved)."""
    hbm_bytes: float
    """Device memory a framework can allocate, bytes (what nvidia-smi / rocm-smi report, not the marketing GB)."""
    hbm_bandwidth_bytes_per_s: float
    scale_up_bandwidth_bytes_per_s: float
    """Scale-up (NVLink/xGMI) bandwidth per accelerator, ONE direction, bytes/s."""
    scale_out_bandwidth_bytes_per_s: float
    """Scale-out NIC bandwidth per accelerator, one direction, bytes/s."""
    default_accelerators_per_node: int
    source: str
    """Citations for the numbers above."""
    host_link_bandwidth_bytes_per_s: float | None = None
    """Device <-> host memory link (PCIe) per accelerator, one direction, bytes/s; None where device memory is host
    memory (``cpu``). Colocated streaming moves suspended engines' weights and KV cache over it."""
    host_memory_bytes_per_node: float | None = None
    """Host DRAM of one server of ``default_accelerators_per_node`` accelerators, bytes; None where device memory is
    host memory (``cpu``). A colocated plan parks the trainer's state in it while the engines roll out, and the
    engines' weights (and, in streaming, their KV cache) while the trainer trains."""

    def __post_init__(self) -> None:
        for field in ("bf16_flops", "hbm_bytes", "hbm_bandwidth_bytes_per_s",
                      "scale_up_bandwidth_bytes_per_s", "scale_out_bandwidth_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Accelerator {self.name!r}: {field} must be > 0")
        if self.host_link_bandwidth_bytes_per_s is not None and not self.host_link_bandwidth_bytes_per_s > 0:
            raise ValueError(f"Accelerator {self.name!r}: host_link_bandwidth_bytes_per_s must be > 0 or None")
        if self.host_memory_bytes_per_node is not None and not self.host_memory_bytes_per_node > 0:
            raise ValueError(f"Accelerator {self.name!r}: host_memory_bytes_per_node must be > 0 or None")
        if self.default_accelerators_per_node < 1:
            raise ValueError(f"Accelerator {self.name!r}: default_accelerators_per_node must be >= 1")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Roofline ridge point F / BW (FLOP/byte): kernels below this arithmetic intensity are memory-bound."""
        return self.bf16_flops / self.hbm_bandwidth_bytes_per_s


def _acc(**kw: object) -> Accelerator:
    return Accelerator(**kw)  # type: ignore[arg-type]


_CATALOG: dict[str, Accelerator] = {
    "h100": _acc(
        name="h100",
        description="NVIDIA H100 SXM5 80GB (HBM3, NVLink4, 400G ConnectX-7 per GPU)",
        # NVIDIA H100 Tensor Core GPU data sheet: BF16 1,979 TFLOPS "with sparsity" -> 989.5 dense.
        bf16_flops=989.5e12,
        # nvidia-smi reports 81,559 MiB on H100 SXM5 80GB.
        hbm_bytes=81_559 * _MIB,
        # H100 data sheet: 3.35 TB/s (SXM).
        hbm_bandwidth_bytes_per_s=3.35e12,
        # H100 data sheet: NVLink 900 GB/s bidirectional -> 450 GB/s per direction.
        scale_up_bandwidth_bytes_per_s=450e9,
        # DGX H100 user guide: 8x ConnectX-7 400 Gb/s compute NICs, one per GPU -> 50 GB/s.
        scale_out_bandwidth_bytes_per_s=50e9,
        # H100 data sheet: PCIe Gen5 128 GB/s (x16, bidirectional) -> 64 GB/s per direction.
        host_link_bandwidth_bytes_per_s=64e9,
        # DGX H100 data sheet: 2 TB of system memory (32 x 64 GB DDR5).
        host_memory_bytes_per_node=2048 * _GIB,
        default_accelerators_per_node=8,
        source="NVIDIA H100 data sheet (nvidia.com/en-us/data-center/h100); DGX H100 user guide (8x CX-7 400G); "
        "verl flops_counter._DEVICE_FLOPS uses 989e12",
    ),
    "h800": _acc(
        name="h800",
        description="NVIDIA H800 SXM5 80GB (export variant of H100: NVLink cut to 400 GB/s)",
        # Same SM array and clocks as H100 SXM: dense BF16 989.5 TFLOP/s (verl _DEVICE_FLOPS lists 989e12).
        bf16_flops=989.5e12,
        hbm_bytes=81_559 * _MIB,
        hbm_bandwidth_bytes_per_s=3.35e12,
        # DeepSeek-V3 technical report (arXiv 2412.19437, sec. 3.1): NVLink 160 GB/s achieved vs IB 50 GB/s;
        # NVIDIA H800 spec: NVLink 400 GB/s bidirectional -> 200 GB/s per direction.
        scale_up_bandwidth_bytes_per_s=200e9,
        # DeepSeek-V3 report: 400 Gb/s InfiniBand per GPU (~50 GB/s).
        scale_out_bandwidth_bytes_per_s=50e9,
        # H800 spec sheet: PCIe Gen5 128 GB/s bidirectional -> 64 GB/s per direction.
        host_link_bandwidth_bytes_per_s=64e9,
        # Assumed: an HGX H800 server configured as the DGX H100 (2 TB); OEM servers vary.
        host_memory_bytes_per_node=2048 * _GIB,
        default_accelerators_per_node=8,
        source="NVIDIA H800 spec sheet (NVLink 400 GB/s); DeepSeek-V3 technical report arXiv 2412.19437 "
        "(H800 cluster, IB 50 GB/s per GPU); verl flops_counter (989e12)",
    ),
    "h20": _acc(
        name="h20",
        description="NVIDIA H20 96GB (export variant: reduced compute, full HBM3 bandwidth)",
        # verl flops_counter._DEVICE_FLOPS: H20 148e12 dense BF16; NVIDIA H20 spec lists 148 TFLOPS BF16.
        bf16_flops=148e12,
        # 96 GB HBM3 (spec); nvidia-smi reports 97,871 MiB.
        hbm_bytes=97_871 * _MIB,
        # NVIDIA H20 spec: 4.0 TB/s.
        hbm_bandwidth_bytes_per_s=4.0e12,
        # NVIDIA H20 spec: NVLink 900 GB/s bidirectional.
        scale_up_bandwidth_bytes_per_s=450e9,
        # Typical HGX H20 build with one 400 Gb/s NIC per GPU (uncertain: varies by vendor).
        scale_out_bandwidth_bytes_per_s=50e9,
        # H20 spec: PCIe Gen5 x16, 128 GB/s bidirectional -> 64 GB/s per direction.
        host_link_bandwidth_bytes_per_s=64e9,
        # Assumed: an HGX H20 server configured as the DGX H100 (2 TB); OEM servers vary.
        host_memory_bytes_per_node=2048 * _GIB,
        default_accelerators_per_node=8,
        source="NVIDIA H20 spec (148 TFLOPS BF16, 96 GB, 4.0 TB/s, NVLink 900 GB/s); verl flops_counter (148e12); "
        "NIC per GPU assumed 400 Gb/s (vendor-dependent)",
    ),
    "h200": _acc(
        name="h200",
        description="NVIDIA H200 SXM 141GB (HBM3e, NVLink4)",
        # NVIDIA H200 data sheet: BF16 1,979 TFLOPS with sparsity -> 989.5 dense.
        bf16_flops=989.5e12,
        # 141 GB marketing; nvidia-smi reports 143,771 MiB.
        hbm_bytes=143_771 * _MIB,
        # H200 data sheet: 4.8 TB/s.
        hbm_bandwidth_bytes_per_s=4.8e12,
        scale_up_bandwidth_bytes_per_s=450e9,
        # DGX H200: 8x ConnectX-7 400 Gb/s.
        scale_out_bandwidth_bytes_per_s=50e9,
        # H200 data sheet: PCIe Gen5 128 GB/s bidirectional -> 64 GB/s per direction.
        host_link_bandwidth_bytes_per_s=64e9,
        # DGX H200 data sheet: 2 TB of system memory.
        host_memory_bytes_per_node=2048 * _GIB,
        default_accelerators_per_node=8,
        source="NVIDIA H200 data sheet (nvidia.com/en-us/data-center/h200); DGX H200 (8x CX-7 400G)",
    ),
    "a100-80g": _acc(
        name="a100-80g",
        description="NVIDIA A100 SXM4 80GB (HBM2e, NVLink3)",
        # NVIDIA A100 data sheet: BF16 312 TFLOPS dense (624 with sparsity).
        bf16_flops=312e12,
        # nvidia-smi reports 81,920 MiB on A100 80GB.
        hbm_bytes=81_920 * _MIB,
        # A100 80GB SXM data sheet: 2,039 GB/s.
        hbm_bandwidth_bytes_per_s=2.039e12,
        # NVLink3 600 GB/s bidirectional.
        scale_up_bandwidth_bytes_per_s=300e9,
        # DGX A100: 8x ConnectX-6 200 Gb/s HDR compute NICs -> 25 GB/s per GPU.
        scale_out_bandwidth_bytes_per_s=25e9,
        # A100 data sheet: PCIe Gen4 64 GB/s bidirectional -> 32 GB/s per direction.
        host_link_bandwidth_bytes_per_s=32e9,
        # DGX A100 640GB data sheet: 2 TB of system memory (the 320GB system has 1 TB).
        host_memory_bytes_per_node=2048 * _GIB,
        default_accelerators_per_node=8,
        source="NVIDIA A100 data sheet (312 TFLOPS BF16 dense, 2,039 GB/s, NVLink 600 GB/s); DGX A100 user guide "
        "(8x 200 Gb/s HDR)",
    ),
    "b200": _acc(
        name="b200",
        description="NVIDIA B200 (HGX/DGX B200, HBM3e, NVLink5)",
        # DGX B200 / HGX B200 spec: 72 PFLOPS FP8 training per 8 GPUs -> 9 PF FP8 per GPU with sparsity, 4.5 PF
        # dense FP8, 2.25 PF dense BF16;
        # verl flops_counter._DEVICE_FLOPS lists B200 at 2.25e15.
        bf16_flops=2.25e15,
        # 192 GB HBM3e marketing; about 179 GiB visible to CUDA (secondary reports of nvidia-smi on DGX B200).
        hbm_bytes=179 * _GIB,
        # NVIDIA Blackwell spec: 8 TB/s.
        hbm_bandwidth_bytes_per_s=8.0e12,
        # NVLink5: 1.8 TB/s bidirectional per GPU.
        scale_up_bandwidth_bytes_per_s=900e9,
        # DGX B200: 8x ConnectX-7 400 Gb/s (newer builds ship ConnectX-8 800 Gb/s; override when so).
        scale_out_bandwidth_bytes_per_s=50e9,
        # HGX B200: PCIe Gen5 x16 to the host, 128 GB/s bidirectional -> 64 GB/s per direction.
        host_link_bandwidth_bytes_per_s=64e9,
        # DGX B200 data sheet: 2 TB of system memory, configurable to 4 TB.
        host_memory_bytes_per_node=2048 * _GIB,
        default_accelerators_per_node=8,
        source="NVIDIA DGX B200 data sheet (72 PF FP8 / 8 GPUs, 1.44 TB HBM3e, 8x CX-7 400G); NVLink5 1.8 TB/s; "
        "verl flops_counter (2.25e15); usable HBM from secondary reports",
    ),
    "mi300x": _acc(
        name="mi300x",
        description="AMD Instinct MI300X 192GB (HBM3, Infinity Fabric / xGMI)",
        # AMD MI300X data sheet: 1,307.4 TFLOPS dense BF16 (2,614.9 with sparsity).
        bf16_flops=1307.4e12,
        # 192 GB HBM3: 8 stacks x 24 GiB.
        hbm_bytes=192 * _GIB,
        # AMD data sheet: 5.3 TB/s.
        hbm_bandwidth_bytes_per_s=5.3e12,
        # AMD data sheet: 896 GB/s aggregate bidirectional Infinity Fabric (7 links x 128 GB/s) -> 448 GB/s one
        # direction in aggregate; a single peer link is only 64 GB/s per direction.
        scale_up_bandwidth_bytes_per_s=448e9,
        # Typical MI300X platform with one 400 Gb/s NIC per GPU (uncertain: varies by vendor).
        scale_out_bandwidth_bytes_per_s=50e9,
        # MI300X data sheet: PCIe Gen5 x16, 128 GB/s bidirectional -> 64 GB/s per direction.
        host_link_bandwidth_bytes_per_s=64e9,
        # Assumed: 2 TB, as the DGX-class 8-GPU servers above; MI300X OEM servers take 1.5-6 TB.
        host_memory_bytes_per_node=2048 * _GIB,
        default_accelerators_per_node=8,
        source="AMD Instinct MI300X data sheet (amd.com: 1307.4 TFLOPS BF16, 192 GB, 5.3 TB/s, 896 GB/s IF); "
        "NIC per GPU assumed 400 Gb/s",
    ),
    "cpu": _acc(
        name="cpu",
        description="One x86-64 CPU core with AVX2 FMA (the dev machine's class, AMD EPYC Zen 3), as one "
        "'accelerator'",
        # Zen 3: two 256-bit FMA pipes = 16 fp32 FMA = 32 FLOP per cycle, at ~2.45 GHz -> ~78 GFLOP/s.  The local
        # engine computes in fp32 (no native BF16 arithmetic on Zen 3), so this is the fp32 FMA peak.
        bf16_flops=78e9,
        # Share of this machine's RAM given to one core's worker (rough default).
        hbm_bytes=8 * _GIB,
        # Single-core streaming bandwidth on server x86 is roughly 15-25 GB/s (rough default).
        hbm_bandwidth_bytes_per_s=20e9,
        # Core-to-core exchange through shared memory / the Ray object store (rough default).
        scale_up_bandwidth_bytes_per_s=5e9,
        # 10 GbE between hosts (rough default).
        scale_out_bandwidth_bytes_per_s=1.25e9,
        default_accelerators_per_node=2,
        source="ROUGH DEFAULTS, to be replaced by `dora calibrate`: AMD Zen 3 microarchitecture (2x256-bit FMA "
        "per core) at ~2.45 GHz; memory and link rates are order-of-magnitude guesses for a cloud VM core",
    ),
}

ACCELERATORS: Mapping[str, Accelerator] = MappingProxyType(_CATALOG)


def gib(nbytes: float, decimals: int = 1) -> str:
    """``nbytes`` in GiB, at ``decimals`` decimals; in powers of ten from a million GiB on (a spec's architecture may
    be absurd: its sizes are bounded only as config.json's are, and 5.4e+26 reads where 27 digits do not)."""
    value = nbytes / _GIB
    return f"{value:.{decimals}f}" if abs(value) < 1e6 else f"{value:.2e}"


def get_accelerator(name: str) -> Accelerator:
    """Catalog entry by key; unknown names raise KeyError listing the valid ones."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; valid names: {', '.join(sorted(ACCELERATORS))}") from None


def with_overrides(
    acc: Accelerator,
    *,
    scale_up_bandwidth_bytes_per_s: float | None = None,
    scale_out_bandwidth_bytes_per_s: float | None = None,
    host_memory_bytes_per_node: float | None = None,
) -> Accelerator:
    """Copy of `acc` with the cluster's actual link rates (e.g. a site with 2x400G per GPU) and host memory."""
    changes: dict[str, Any] = {}
    if host_memory_bytes_per_node is not None:
        changes["host_memory_bytes_per_node"] = host_memory_bytes_per_node
    if scale_up_bandwidth_bytes_per_s is not None:
        changes["scale_up_bandwidth_bytes_per_s"] = scale_up_bandwidth_bytes_per_s
    if scale_out_bandwidth_bytes_per_s is not None:
        changes["scale_out_bandwidth_bytes_per_s"] = scale_out_bandwidth_bytes_per_s
    if not changes:
        return acc
    return dataclasses.replace(acc, source=acc.source + "; overridden by the cluster spec", **changes)


def catalog_fingerprint() -> str:
    """First 16 hex digits of sha256 over the sorted JSON of every catalog entry."""
    blob = json.dumps({k: dataclasses.asdict(v) for k, v in ACCELERATORS.items()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----- links and collectives -----------------------------------------------------------------------------------
def group_link_bandwidth_bytes_per_s(
    acc: Accelerator, *, group_size: int, inner_size: int = 1, accelerators_per_node: int | None = None
) -> float:
    """Peak one-direction bandwidth per accelerator for a collective over `group_size` ranks.

    Ranks of a group are `inner_size` apart in the device order (TP innermost: inner_size=1; DP after TP*CP:
    inner_size=tp*cp).  The group stays on scale-up links when group_size * inner_size <= accelerators per
    node, otherwise its bottleneck is the scale-out NIC.  Units: bytes/s.
    """
    per_node = accelerators_per_node or acc.default_accelerators_per_node
    if group_size * inner_size <= per_node:
        return acc.scale_up_bandwidth_bytes_per_s
    return acc.scale_out_bandwidth_bytes_per_s


def ring_all_reduce_s(payload_bytes: float, *, group_size: int, bandwidth_bytes_per_s: float,
                      efficiency: float, latency_s: float) -> float:
    """Ring all-reduce: each rank sends and receives 2*(g-1)/g * X bytes.

    t = 2*(g-1)/g * X / (eta * BW) + latency.  Zero for g = 1.  X in bytes, BW in bytes/s, t in s.
    """
    if group_size <= 1 or payload_bytes <= 0:
        return 0.0
    return 2 * (group_size - 1) / group_size * payload_bytes / (efficiency * bandwidth_bytes_per_s) + latency_s


def ring_all_gather_s(payload_bytes: float, *, group_size: int, bandwidth_bytes_per_s: float,
                      efficiency: float, latency_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a full tensor of X bytes: (g-1)/g * X per rank.

    t = (g-1)/g * X / (eta * BW) + latency.  Zero for g = 1.
    """
    if group_size <= 1 or payload_bytes <= 0:
        return 0.0
    return (group_size - 1) / group_size * payload_bytes / (efficiency * bandwidth_bytes_per_s) + latency_s


def all_to_all_s(bytes_per_rank: float, *, group_size: int, bandwidth_bytes_per_s: float,
                 efficiency: float, latency_s: float) -> float:
    """All-to-all where each rank holds `bytes_per_rank` to scatter uniformly: (g-1)/g of it leaves the rank.

    t = (g-1)/g * X_rank / (eta * BW) + latency.  Zero for g = 1.
    """
    if group_size <= 1 or bytes_per_rank <= 0:
        return 0.0
    return (group_size - 1) / group_size * bytes_per_rank / (efficiency * bandwidth_bytes_per_s) + latency_s
