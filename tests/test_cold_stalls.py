"""bench/cold_stalls.py: the spread of the cold kernel's calls and the rates at the median and the mean."""

import numpy as np
import pytest


def test_stats_of_a_known_spread():
    from bench.cold_stalls import stats

    times = np.array([1e-3] * 98 + [5e-3, 9e-3])  # s: two stalls among 100 calls
    s = stats(times, 1e6)  # 1 MB a call
    assert s["median_ms"] == pytest.approx(1.0) and s["max_ms"] == pytest.approx(9.0)
    assert s["mean_ms"] == pytest.approx(1.12) and s["over_2x_median"] == 2 and s["p99_ms"] == pytest.approx(9.0)
    assert s["rate_at_median"] == pytest.approx(1e9) and s["rate_at_mean"] == pytest.approx(1e9 / 1.12)


def test_main_times_each_thread_count_and_writes_the_record(tmp_path):
    import json

    from bench.cold_stalls import main

    out = tmp_path / "stalls.json"
    fig = main(["--threads", "1", "--noise", "none", "--d", "256", "--rows", "16", "--calls", "5",
                "--table-bytes", str(2**20), "--out", str(out)])
    row = fig["runs"]["none"]["1"]
    assert row["calls"] == 5 and 0 < row["median_ms"] <= row["max_ms"] and row["rate_at_median"] > 0
    assert json.loads(out.read_text())["figures"]["runs"]["none"]["1"]["calls"] == 5
    with pytest.raises(SystemExit, match="--noise loud"):
        main(["--noise", "loud"])


def test_default_threads_are_every_core(monkeypatch):
    import numba
    from hotneurons.kernels.cold import default_threads, set_threads

    for cores, want in ((16, 16), (8, 8), (2, 2), (1, 1)):
        monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", cores)
        assert default_threads() == want
    monkeypatch.undo()
    n = numba.config.NUMBA_NUM_THREADS
    assert set_threads(None) == default_threads() and set_threads(1) == 1 and set_threads(10**6) == n
    set_threads(None)
