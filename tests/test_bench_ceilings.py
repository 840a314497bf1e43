"""pi-bench's floors and ceilings (bench/bench_ceilings.py): the floor's arithmetic, the DRAM ceiling against what the
cold kernel read, and the floor with the cold rows at the kernel's rate."""

import pytest

from bench import bench_ceilings as ceil
from bench import bench_model as bm


def test_floor_arithmetic():
    layers = [{"gpu_bytes": 3e9, "cold_bytes": 1e9}, {"gpu_bytes": 1e9, "cold_bytes": 2e9},
              {"gpu_bytes": 2e9, "cold_bytes": 0}]
    f = ceil.floor(layers, hbm_bw=2e12, dram_bw=1e11, sync_s=30e-6, outside_gpu_bytes=1e9)
    # layer 0: max(1.5 ms, 10 ms) + 30 us; layer 1: max(0.5 ms, 20 ms) + 30 us; layer 2: 1 ms, no sync; head 0.5 ms
    want = (10e-3 + 30e-6) + (20e-3 + 30e-6) + 1e-3 + 0.5e-3
    assert f["seconds_per_token"] == pytest.approx(want)
    assert f["tokens_per_s"] == pytest.approx(1 / want)
    assert f["gpu_bound_layers"] == 1
    assert f["serial_seconds_per_token"] == pytest.approx(want)  # no serial bytes: the same floor
    # serial: layer 0 reads 2e9 of its 3e9 GPU bytes before its FFN: 1 ms + max(0.5 ms, 10 ms) + 30 us
    layers[0]["serial_gpu_bytes"] = 2e9
    layers[2]["serial_gpu_bytes"] = 2e9  # all of it: 1 ms + max(0, 0)
    f = ceil.floor(layers, hbm_bw=2e12, dram_bw=1e11, sync_s=30e-6, outside_gpu_bytes=1e9)
    assert f["seconds_per_token"] == pytest.approx(want)
    assert f["serial_seconds_per_token"] == pytest.approx(want + 1e-3)


def test_dram_ceiling_is_at_least_what_the_cold_kernel_read():
    """A row gather that read less than the cold kernel in the same run is no ceiling: the floors and the kernel's
    shares take the kernel's best rate (the per-generation floors too), and the read kernels' figure is kept."""
    hybrid = {"cold_dtype": "bf16", "pcie_share": 0.0, "decode_tokens_per_s_reps": [100.0],
              "per_layer_counts": [{"tokens": 10, "n_hot": 64, "active_cold": 1000}],
              "dram_around_bytes_per_s": {"before": 90e9, "after": 110e9, "per_rep": [100e9]}}

    def run(kernel_rate):
        c = {"dram": {"best_bytes_per_s": 120e9, "best": "gather"}, "hbm_bytes_per_s": 3e12}
        res = {"systems": {"hybrid": hybrid}, "kernel": {"rows": [{"density": 0.05, "bytes_per_s": kernel_rate}]}}
        ceil.add_floors(res, c, "tiny", 1, 0)
        return res, c

    res, c = run(100e9)  # below the gather: the ceilings stand
    assert c["dram"]["best_bytes_per_s"] == 120e9 and res["kernel"]["rows"][0]["share_of_dram_bw"] == 100 / 120
    assert res["floor_per_rep"]["dram_bytes_per_s"] == [100e9]
    low = res["floor"]["tokens_per_s"]
    res, c = run(130e9)
    assert c["dram"]["best_bytes_per_s"] == 130e9 and c["dram"]["read_kernels_best_bytes_per_s"] == 120e9
    assert res["kernel"]["rows"][0]["share_of_dram_bw"] == 1.0 and res["floor"]["tokens_per_s"] > low
    assert res["floor"]["inputs"]["dram_bytes_per_s"] == 130e9
    assert res["floor_around_run"]["inputs"]["dram_bytes_per_s"] == 130e9  # the around-run mean, 100e9, raised
    assert res["floor_per_rep"]["floor_tokens_per_s"] == [res["floor"]["tokens_per_s"]]


def test_floor_bound_reads_cold_rows_at_the_kernels_rate():
    """floor_bound: the serial floor with the cold rows at the sparsest kernel row's rate; the rate that the goal
    needs puts the serial floor at 0.7 of the floor (by hand from floor()); none where even endless DRAM cannot."""
    d = bm.SHAPES["tiny"][0]
    hybrid = {"cold_dtype": "bf16", "pcie_share": 0.0,
              "per_layer_counts": [{"tokens": 4, "n_hot": 64, "active_cold": 4000}] * 2}
    c = {"dram": {"best_bytes_per_s": 100e9}, "hbm_bytes_per_s": 2e12, "sync_round_trip_s": 20e-6}
    kern = [{"density": 0.2, "bytes_per_s": 95e9}, {"density": 0.05, "bytes_per_s": 80e9}]
    floor = ceil.floor_from_hybrid(hybrid, c, "tiny", 2, 1000)
    b = ceil.floor_bound(hybrid, c, "tiny", 2, 1000, kern, floor["tokens_per_s"])
    assert b["kernel_density"] == 0.05 and b["kernel_share_of_dram"] == pytest.approx(0.8)
    at80 = ceil.floor_from_hybrid(hybrid, c, "tiny", 2, 1000, 80e9)
    assert b["serial_tokens_per_s"] == pytest.approx(at80["serial_tokens_per_s"])
    assert b["share_of_floor"] == pytest.approx(at80["serial_tokens_per_s"] / floor["tokens_per_s"])
    rows, outside = at80["inputs"]["layers"], at80["inputs"]["lm_head_bytes"] + 2 * d
    need = ceil.floor(rows, 2e12, b["kernel_share_needed"] * 100e9, 20e-6, outside)["serial_tokens_per_s"]
    assert need == pytest.approx(0.7 * floor["tokens_per_s"], rel=1e-6)
    assert ceil.floor_bound(hybrid, c, "tiny", 2, 1000, kern, 1e9)["kernel_share_needed"] == float("inf")
