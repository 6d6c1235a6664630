"""Accelerator catalog and calibration object: keys, units, overrides, fingerprints."""

import json

import pytest

from planner.calibration import DEFAULT_CALIBRATION, Calibration
from planner.hardware import ACCELERATORS, catalog_fingerprint, get_accelerator, with_overrides

EXPECTED_KEYS = {"h100", "h800", "h20", "h200", "a100-80g", "b200", "mi300x", "cpu"}


def test_catalog_has_exactly_the_contract_keys():
    assert set(ACCELERATORS) == EXPECTED_KEYS
    for key, acc in ACCELERATORS.items():
        assert acc.name == key
        assert acc.source


@pytest.mark.parametrize(
    ("name", "tflops", "hbm_tb_s", "nvlink_one_way_gb_s"),
    [
        ("h100", 989.5, 3.35, 450),
        ("h800", 989.5, 3.35, 200),
        ("h20", 148, 4.0, 450),
        ("h200", 989.5, 4.8, 450),
        ("a100-80g", 312, 2.039, 300),
        ("b200", 2250, 8.0, 900),
        ("mi300x", 1307.4, 5.3, 448),
    ],
)
def test_dense_datasheet_values(name, tflops, hbm_tb_s, nvlink_one_way_gb_s):
    acc = get_accelerator(name)
    assert acc.bf16_flops == pytest.approx(tflops * 1e12)
    assert acc.hbm_bandwidth_bytes_per_s == pytest.approx(hbm_tb_s * 1e12)
    assert acc.scale_up_bandwidth_bytes_per_s == pytest.approx(nvlink_one_way_gb_s * 1e9)


def test_units_are_bytes_and_memory_is_ordered():
    gib = 1024**3
    assert 79 * gib < get_accelerator("h100").hbm_bytes < 80 * gib
    assert get_accelerator("h200").hbm_bytes > get_accelerator("h20").hbm_bytes > get_accelerator("h100").hbm_bytes
    # A 400 Gb/s NIC is 50 GB/s, not 400e9.
    assert get_accelerator("h100").scale_out_bandwidth_bytes_per_s == pytest.approx(50e9)


def test_h100_ridge_point_hand_computed():
    # 989.5e12 / 3.35e12 = 295.37 FLOP/byte: decode stays memory-bound until batch ~ hundreds.
    assert get_accelerator("h100").ridge_flops_per_byte == pytest.approx(295.37, rel=1e-3)


def test_cpu_entry_is_marked_as_rough_defaults():
    cpu = get_accelerator("cpu")
    assert cpu.default_accelerators_per_node == 2
    assert "ROUGH DEFAULTS" in cpu.source
    assert cpu.bf16_flops < 1e12


def test_unknown_accelerator_lists_valid_names():
    with pytest.raises(KeyError, match="valid names: a100-80g, b200, cpu"):
        get_accelerator("h300")


def test_with_overrides_replaces_only_links():
    h100 = get_accelerator("h100")
    site = with_overrides(h100, scale_out_bandwidth_bytes_per_s=100e9)
    assert site.scale_out_bandwidth_bytes_per_s == 100e9
    assert site.scale_up_bandwidth_bytes_per_s == h100.scale_up_bandwidth_bytes_per_s
    assert site.bf16_flops == h100.bf16_flops
    assert "overridden" in site.source
    assert with_overrides(h100) is h100
    assert site.host_memory_bytes_per_node == h100.host_memory_bytes_per_node == 2048 * 1024**3
    big = with_overrides(h100, host_memory_bytes_per_node=4096 * 1024**3)
    assert big.host_memory_bytes_per_node == 4096 * 1024**3 and big.hbm_bytes == h100.hbm_bytes


def test_host_memory_is_per_node_and_absent_on_cpu():
    """Every GPU entry has a host memory (a colocated plan parks state there); ``cpu``'s device memory is host memory."""
    import dataclasses

    assert all(a.host_memory_bytes_per_node for name, a in ACCELERATORS.items() if name != "cpu")
    assert get_accelerator("cpu").host_memory_bytes_per_node is None
    with pytest.raises(ValueError, match="host_memory_bytes_per_node must be > 0 or None"):
        dataclasses.replace(get_accelerator("h100"), host_memory_bytes_per_node=0.0)


def test_catalog_fingerprint_is_stable_hex():
    fp = catalog_fingerprint()
    assert fp == catalog_fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0


def test_calibration_round_trips_through_json():
    calib = DEFAULT_CALIBRATION.with_overrides(hbm_bandwidth_efficiency=0.7, source="measured: test")
    again = Calibration.from_dict(json.loads(json.dumps(calib.to_dict())))
    assert again == calib
    assert again.fingerprint() == calib.fingerprint() != DEFAULT_CALIBRATION.fingerprint()
    assert DEFAULT_CALIBRATION.source == "catalog defaults"


def test_calibration_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown calibration key 'hbm_eff'"):
        Calibration.from_dict({"hbm_eff": 0.5})
    with pytest.raises(ValueError, match="unknown calibration key 'nope'"):
        DEFAULT_CALIBRATION.with_overrides(nope=1)
    with pytest.raises(ValueError, match=r"train_mfu_dense = 1.5 must lie in \(0, 1\]"):
        Calibration(train_mfu_dense=1.5)
    with pytest.raises(ValueError, match="moe_imbalance_factor"):
        Calibration(moe_imbalance_factor=0.9)
    with pytest.raises(ValueError, match="collective_latency_s"):
        Calibration(collective_latency_s=-1.0)
    # far past anything measured: typos that would overflow the cost model (a 1e308 s overhead divided by zero)
    with pytest.raises(ValueError, match=r"cpu_step_overhead_s = 1e\+308 must lie in \[0, 3600\] seconds"):
        Calibration(cpu_step_overhead_s=1e308)
    with pytest.raises(ValueError, match="cpu_compute_efficiency = 1e-300 must be at least 1e-06"):
        Calibration(cpu_compute_efficiency=1e-300)
    with pytest.raises(ValueError, match=r"cpu_rollout_contention = 1000000000.0 must lie in \[1, 1000\]"):
        Calibration(cpu_rollout_contention=1e9)


def test_calibration_resolves_cpu_constants():
    cpu = DEFAULT_CALIBRATION.resolved_for("cpu")
    assert cpu.decode_compute_efficiency == DEFAULT_CALIBRATION.cpu_compute_efficiency
    assert cpu.decode_step_overhead_s == DEFAULT_CALIBRATION.cpu_step_overhead_s
    assert DEFAULT_CALIBRATION.resolved_for("h100") is DEFAULT_CALIBRATION
