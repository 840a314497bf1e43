"""bench/gate_sketch.py: the coarse gate's levels and the candidates' accounting."""

import numpy as np
import pytest


def test_sketch_levels_and_error_shrink_with_bits():
    from bench.gate_sketch import sketch

    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    errs = []
    for bits in (1, 2, 3):
        s = sketch(w, bits)
        assert all(len(np.unique(blk)) <= 2 ** bits for blk in s.reshape(-1, 32))  # levels per block of 32
        errs.append(float(np.abs(s - w).mean()))
    assert errs == sorted(errs, reverse=True)


def test_measure_accounts_sketch_and_candidates():
    from bench.gate_sketch import _ppf, measure

    assert _ppf(np.array([0.5, 0.975])) == pytest.approx([0.0, 1.959964], abs=1e-5)
    fig = measure(d=128, n=64, calib=64, test=64, bits=(2,), margins=(3, 50))
    loose = fig["rows"][1]
    assert 0 < fig["fires"] < 1 and loose["candidates"] == 1.0 and loose["recall"] == 1.0  # a huge margin: all
    assert all(r["gate_bytes_read"] == pytest.approx(2 / 4.5 + r["candidates"]) for r in fig["rows"])
