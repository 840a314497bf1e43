"""--pcie-share (runtime/balance.py): cold rows shared with the device equal HF; the share's balancing and re-check on
a simulated machine; next_share's step; the share's range."""

import numpy as np
import pytest
import tiny
from hotneurons.runtime.generate import RuntimeConfig
from hotneurons.runtime.load import build_runtime
from test_runtime import always_on_predictors, check_equal, make_placement


@pytest.mark.parametrize("family,mode,int8", [("llama-reglu", "hybrid", False), ("qwen2-swiglu", "dense", False),
                                             ("llama-reglu", "hybrid", True)])
def test_cold_rows_shared_with_the_device_equal_hf(family, mode, int8, tiny_model_dir, monkeypatch):
    """--pcie-share: after the calibration tokens the device computes the first marked cold neurons of each token
    from the rows in place (here on the CPU, as views) and the CPU the rest; the logits stay HF's."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "CALIBRATION_TOKENS", 4)
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    if int8:
        tiny.round_ffns_to_int8(lm)
    cfg = RuntimeConfig(device="cpu", mode=mode, pcie_share=0.5, cold_dtype="int8" if int8 else "bf16")
    preds = always_on_predictors(lm, -1e30) if mode == "hybrid" else None
    g = check_equal(lm, cfg, make_placement(lm, "cpu" if mode == "dense" else "mixed"), preds)
    rt_ffns = [m for m in lm.model.modules() if hasattr(m, "mapped_rows")]
    n_cold = [f.n_cold for f in rt_ffns]
    assert [f.mapped_rows for f in rt_ffns] == [round(0.5 * n) for n in n_cold]  # every cold neuron marked here
    assert g.stats["pcie_share"] == 0.5 and g.stats["pcie_rows_per_layer"] > 0
    assert g.stats["pcie_balance"] == []  # a given share is not moved
    assert all(r > 0 for r in B.measure_pcie_rates(rt_ffns[0], rows=16, reps=2))


class SimulatedMachine:
    """tune_mapped_rows on a simulated machine: a layer's GPU part takes hot_ms + K / device_rate, its CPU part
    (marked - K) / cpu_rate times a factor that varies by `spread` from layer to layer and token to token, and the
    next layer's wait grows by whatever the GPU part ran past the CPU's (5 us of clock noise; the GPU's rate measured
    at start off by `believed`). `cpu_rate` may be changed between steps (another load on the machine)."""

    layers, marked, pre_ms = 12, 1880, 0.285

    def __init__(self, hot_ms, device_rate, cpu_rate, start, believed, spread):
        from types import SimpleNamespace

        import hotneurons.runtime.balance as B

        self.B, self.hot_ms, self.device_rate, self.cpu_rate, self.spread = B, hot_ms, device_rate, cpu_rate, spread
        self.rng = np.random.default_rng(0)
        self.ffns = [SimpleNamespace(cold_marks=np.zeros(2), mapped=object(), mapped_rows=0, reset_graphs=lambda: None)
                     for _ in range(self.layers)]
        self.fast = SimpleNamespace(timing=[], layers=self.ffns, reset_graphs=lambda: None)
        self.rt = SimpleNamespace(cfg=RuntimeConfig(), pcie_tuned=False, pcie_share=start, ffns=self.ffns,
                                  fast=self.fast, pcie_balance=B.ShareBalance(believed * device_rate))

    def factor(self, size: int) -> np.ndarray:  # the CPU part's spread
        return np.exp(self.rng.normal(0, self.spread, size))

    def layer_ms(self, k: float, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # (GPU past the CPU, CPU part)
        cpu = (self.marked - k) / self.cpu_rate * f
        return np.maximum(0.0, self.hot_ms + k / self.device_rate - cpu), cpu

    def run(self, steps: int) -> None:
        for _ in range(steps):
            over, cpu = self.layer_ms(self.ffns[0].mapped_rows, self.factor(self.layers))
            if self.fast.timing is not None:
                noise = self.rng.normal(0, 0.005, self.layers + 1)
                self.fast.timing.append({"wait_pre_ms": list(self.pre_ms + np.r_[0.0, over[:-1]] + noise[:-1]),
                                         "cold_ms": list(cpu), "final_ms": 0.3 + over[-1] + noise[-1]})
            for f in self.ffns:
                f.cold_marks += (1, self.marked)
            self.B.tune_mapped_rows(self.rt)

    def step_ms(self, k: float) -> float:  # a layer's mean time at K rows on the GPU
        sample = self.factor(20000)
        return self.pre_ms + float(np.mean(sum(self.layer_ms(k, sample))))

    def share_is_near_best(self, tol: float = 1.02) -> bool:
        best = min(self.step_ms(k) for k in range(0, self.marked + 1, 4))
        return self.step_ms(self.ffns[0].mapped_rows) <= tol * best


@pytest.mark.parametrize("hot_ms,device_rate,cpu_rate,start,believed,spread", [
    (0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1), (0.14, 1000.0, 1300.0, 0.43, 1.3, 0.1),
    (0.14, 1000.0, 1300.0, 0.43, 0.7, 0.1), (0.14, 1000.0, 1300.0, 0.39, 1.0, 0.0),
    (0.0, 1000.0, 1300.0, 0.1, 1.0, 0.1), (0.3, 600.0, 1500.0, 0.5, 1.0, 0.2),
    (0.05, 2000.0, 800.0, 0.2, 1.0, 0.1)])
def test_share_balancing_finds_the_fastest_split(hot_ms, device_rate, cpu_rate, start, believed, spread):
    """After TUNING_TOKENS steps on a SimulatedMachine the series of rounds is over and the share's mean step is
    within 2% of the best K found by trying every K on the same distribution."""
    m = SimulatedMachine(hot_ms, device_rate, cpu_rate, start, believed, spread)
    m.run(m.B.TUNING_TOKENS)
    rt = m.rt
    assert rt.pcie_tuned and m.fast.timing is None and len(rt.pcie_balance.rounds) == m.B.BALANCE_ROUNDS
    assert m.share_is_near_best(), (rt.pcie_share, rt.pcie_balance.rounds)


@pytest.mark.parametrize("cpu_after", [1300.0, 650.0, 2600.0])
def test_share_is_rechecked_and_moved_when_the_machine_changes(cpu_after, monkeypatch):
    """RECHECK_TOKENS steps after the rounds, one timed round at the share kept: on an unchanged machine it keeps the
    share (no new graphs) and turns the host clock off; where the CPU's rate has since halved or doubled, it starts a
    new series, which ends within 3% of the new best split."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "RECHECK_TOKENS", 64)
    m = SimulatedMachine(0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1)
    m.run(B.TUNING_TOKENS)
    kept = m.ffns[0].mapped_rows
    m.cpu_rate = cpu_after
    m.run(B.RECHECK_TOKENS + B.BALANCE_TOKENS)
    rounds = m.rt.pcie_balance.rounds
    assert len(rounds) == B.BALANCE_ROUNDS + 1 and rounds[-1]["recheck"]
    if cpu_after == 1300.0:
        assert rounds[-1]["gain"] < B.RECHECK_GAIN and m.ffns[0].mapped_rows == kept
        assert m.rt.pcie_tuned and m.fast.timing is None
        return
    assert rounds[-1]["gain"] >= B.RECHECK_GAIN and not m.rt.pcie_tuned
    m.run((B.BALANCE_ROUNDS - 1) * (B.BALANCE_TOKENS + 1))
    assert m.rt.pcie_tuned and m.fast.timing is None and len(m.rt.pcie_balance.rounds) == 2 * B.BALANCE_ROUNDS
    assert m.share_is_near_best(1.03), (m.rt.pcie_share, m.rt.pcie_balance.rounds)


def test_recheck_leaves_another_timeline_alone(monkeypatch):
    """A re-check due while another timeline has the host clock on (bench diagnostics) waits until it is off, and one
    whose clock was taken over starts again: neither list is cut short or read as its own."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "RECHECK_TOKENS", 16)
    m = SimulatedMachine(0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1)
    m.run(B.TUNING_TOKENS)
    theirs = m.fast.timing = []
    m.run(B.RECHECK_TOKENS + 2 * B.BALANCE_TOKENS)
    assert m.fast.timing is theirs and len(theirs) == B.RECHECK_TOKENS + 2 * B.BALANCE_TOKENS
    m.fast.timing = None
    m.run(1)  # the re-check takes the clock
    assert m.fast.timing is m.rt.pcie_balance.clock
    theirs = m.fast.timing = []  # and another timeline takes it over
    m.run(B.BALANCE_TOKENS + 1)
    assert m.fast.timing is theirs and not any(r.get("recheck") for r in m.rt.pcie_balance.rounds)
    m.fast.timing = None
    m.run(B.BALANCE_TOKENS + 2)
    assert m.rt.pcie_balance.rounds[-1]["recheck"]


def test_share_recheck_off_keeps_the_first_series_share(monkeypatch):
    """RuntimeConfig.pcie_recheck=False (a bench A/B): after the first series of rounds the share stays and the host
    clock stays off, although the CPU's rate has since halved."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "RECHECK_TOKENS", 16)
    m = SimulatedMachine(0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1)
    m.rt.cfg = RuntimeConfig(pcie_recheck=False)
    m.run(B.TUNING_TOKENS)
    kept, rounds = m.ffns[0].mapped_rows, len(m.rt.pcie_balance.rounds)
    m.cpu_rate = 650.0
    m.run(B.RECHECK_TOKENS + 2 * B.BALANCE_TOKENS)
    assert m.ffns[0].mapped_rows == kept and len(m.rt.pcie_balance.rounds) == rounds and m.fast.timing is None


def test_next_share_from_overruns_lands_on_the_balance():
    """Without spread in the CPU's times and where the model holds, one round whose GPU part ran past the CPU's moves
    K to where the two end together (to the grid's step)."""
    import hotneurons.runtime.balance as B

    marked, g, c, a, share = 2000.0, 900.0, 1200.0, 0.1, 0.6
    k = share * marked
    cpu, gpu = np.full((4, 12), (marked - k) / c), a + k / g
    new = B.next_share(share, marked, g, gpu - cpu, cpu)[0] * marked
    assert abs((a + new / g) - (marked - new) / c) < 2 * (marked / 256) * (1 / g + 1 / c)


def test_next_share_is_not_moved_by_one_stalled_cpu_part():
    """One CPU part stalled for 20 ms among a round's 48 samples (a page fault, the OS) does not send the share to its
    cap: the stall does not shrink with the rows the CPU keeps (docs/history.md, machine BD)."""
    import hotneurons.runtime.balance as B

    rng = np.random.default_rng(0)
    over, cold = np.abs(rng.normal(0.5, 0.2, (4, 12))), np.abs(rng.normal(0.15, 0.03, (4, 12)))
    calm = B.next_share(0.855, 1142.0, 1000.0, over, cold, 0.418)[0]
    cold[1, 3] = 20.0
    assert calm < 0.855 and B.next_share(0.855, 1142.0, 1000.0, over, cold, 0.418)[0] == pytest.approx(calm, abs=0.02)


def test_pcie_share_out_of_range_is_refused(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    with pytest.raises(ValueError, match="--pcie-share 1.5 is out of range"):
        build_runtime(lm, RuntimeConfig(device="cpu", mode="dense", pcie_share=1.5))
