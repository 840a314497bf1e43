import dataclasses

import pytest
from hotneurons.common.hardware import HARDWARE, HardwareSpec, UnknownHardware, get_hardware, presets_table
from hotneurons.kernels.measure import measure_hardware


def test_presets_are_complete_and_sane():
    for name in ("rtx4090", "rtx3090", "rtx2080ti", "a100-40g", "a100-80g", "h100", "cpu-only"):
        h = get_hardware(name)
        assert h.name == name and h.cpu_bw > 0 and h.cores >= 1
        if name != "cpu-only":
            assert h.has_gpu and h.vram_bytes >= 8 * 2**30 and h.gpu_bw > h.pcie_bw > 0 and h.gpu_bw > h.cpu_bw
            assert h.reserve_bytes > 0 and h.sync_latency_s > 0
    assert not get_hardware("cpu-only").has_gpu
    assert get_hardware(" RTX4090 ") is HARDWARE["rtx4090"]


def test_unknown_name_lists_known_ones():
    with pytest.raises(UnknownHardware) as e:
        get_hardware("gtx480")
    assert all(n in str(e.value) for n in HARDWARE)


def test_spec_is_frozen_and_replace_ignores_none():
    h = get_hardware("rtx4090")
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.vram_bytes = 1
    h2 = h.replace(vram_bytes=None, cores=2)
    assert h2.vram_bytes == h.vram_bytes and h2.cores == 2
    assert h2.effective_cpu_bw == min(h.cpu_bw, 2 * 12e9)


def test_presets_table_lists_all():
    t = presets_table()
    assert all(n in t for n in HARDWARE)


def test_measure_without_cuda_keeps_preset_gpu_values():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: this test covers the CPU-only path")
    base = get_hardware("rtx4090")
    h, notes = measure_hardware(base)
    assert isinstance(h, HardwareSpec) and h.cpu_bw > 1e8 and h.cores >= 1
    assert (h.vram_bytes, h.gpu_bw, h.pcie_bw) == (base.vram_bytes, base.gpu_bw, base.pcie_bw)
    assert any("no CUDA" in n for n in notes)


def test_openmp_wait_policy_by_gpu(monkeypatch):
    from hotneurons.common import hardware

    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hardware.os.path, "exists", lambda p: False)  # no NVIDIA driver
    assert hardware.openmp_wait_policy() == "PASSIVE" and "GOMP_SPINCOUNT" not in hardware.os.environ
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(hardware.os.path, "exists", lambda p: p == "/proc/driver/nvidia/version")
    assert hardware.openmp_wait_policy() == "ACTIVE, GOMP_SPINCOUNT=10000000"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user's choice is kept
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert hardware.openmp_wait_policy() == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden: as without one
    assert hardware.openmp_wait_policy() == "PASSIVE"


@pytest.mark.parametrize("fmt", ["q4_0", "bf16"])
def test_cold_call_rate_is_the_kernels_and_becomes_the_cost_models_cpu_rate(fmt):
    """cold_call_bw times the cold kernels on decode-sized calls; measure_cold_rate makes it the solver's CPU rate and
    says so beside the DRAM figure it replaces. Unknown formats are refused by name."""
    from hotneurons.kernels.dram import cold_call_bw
    from hotneurons.kernels.measure import measure_cold_rate

    assert cold_call_bw(256, fmt, True, 32, table_bytes=2**22, calls=8) > 1e7
    with pytest.raises(ValueError, match="q3_k"):
        cold_call_bw(256, "q3_k", True, 32)
    base = get_hardware("rtx4090")
    model = {"n_neurons": 1024, "d_model": 256, "gated": True}
    h, note = measure_cold_rate(base, model, 0.9, fmt)
    assert h.cpu_bw != base.cpu_bw and h.cpu_bw > 1e7 and h.gpu_bw == base.gpu_bw
    assert f"{h.cpu_bw / 1e9:.1f} GB/s" in note and f"DRAM {base.cpu_bw / 1e9:.1f} GB/s" in note


def test_expert_call_bw_times_the_experts_kernel(monkeypatch):
    """pi-solve --measure on a mixture of experts prices a cold expert at the experts' kernel's own rate: a quarter
    of the routed experts a call, float experts timed as q8_0 rows."""
    from hotneurons.common.hardware import get_hardware
    from hotneurons.kernels import dram
    from hotneurons.kernels.measure import measure_expert_rate

    for fmt in ("q4_0", "q8_0"):
        assert dram.expert_call_bw(64, 32, fmt, 2, table_bytes=1 << 20, calls=4, gap_s=0.0) > 0
    seen = []
    monkeypatch.setattr(dram, "expert_call_bw", lambda d, n, fmt, per: seen.append((d, n, fmt, per)) or 5e9)
    hw, note = measure_expert_rate(get_hardware("h100"), 2048, 768, 8, "bf16")
    assert hw.cpu_bw == 5e9 and seen == [(2048, 768, "q8_0", 2)] and "5.0 GB/s" in note
