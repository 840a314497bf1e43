"""Can a coarse copy of a sparse expert's gate rows say which neurons to read, so that the CPU skips the rest?

The sparse experts' kernel reads every gate row of a routed cold expert (a third of its bytes) to find the ~15-20%
of neurons whose gate passes. A sketch of the gate in fewer bits (per block of 32 weights, symmetric, `bits`) gives
approximate dots; a neuron is a candidate where its approximate dot plus `margin` standard deviations of its error
(measured on calibration tokens) passes, and only candidates' exact gate rows are then read. Reads per token, in
units of the exact gate's bytes (Q4_0, 4.5 bits a weight): sketch bits / 4.5 + candidates' share. Random gate rows of
d 4,096 (normal, scaled by 1/sqrt(d)), biases set so that each neuron passes at a power-law rate averaging ~19%,
random normal tokens: the model's arithmetic, not a real expert's.

    python -m bench.gate_sketch --out results.json
"""

from __future__ import annotations

import argparse
from math import erf, sqrt

import numpy as np


def _ppf(p: np.ndarray) -> np.ndarray:
    """The standard normal's quantile by bisection (no scipy)."""
    lo, hi = np.full_like(p, -9.0), np.full_like(p, 9.0)
    cdf = np.vectorize(lambda z: 0.5 * (1 + erf(z / sqrt(2))))
    for _ in range(60):
        mid = (lo + hi) / 2
        below = cdf(mid) < p
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return (lo + hi) / 2


def sketch(w: np.ndarray, bits: int) -> np.ndarray:
    """w (n, d) rounded to `bits` per weight, symmetric levels +-(k + 1/2) scale per block of 32 (no zero level)."""
    n, d = w.shape
    wb = w.reshape(n, d // 32, 32)
    half = 2 ** (bits - 1)
    sc = np.abs(wb).max(-1, keepdims=True) / (half - 0.5)  # (n, blocks, 1)
    q = np.clip(np.round(wb / sc - 0.5), -half, half - 1) + 0.5
    return (q * sc).reshape(n, d)


def measure(d: int = 4096, n: int = 2048, calib: int = 256, test: int = 256, bits=(1, 2, 3), margins=(3, 4, 5),
            seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)  # (n, d)
    p = np.clip(rng.pareto(2.0, n) * 0.1, 0.005, 0.9)
    p = np.clip(p * 0.19 / p.mean(), 0.002, 0.95)  # (n,) each neuron's pass rate
    b = _ppf(p) * np.linalg.norm(g, axis=1)  # (n,) biases: the dot of a unit-variance token is ~N(0, |g|^2)
    xc, xt = (rng.standard_normal((m, d)).astype(np.float32) for m in (calib, test))
    exact_c, exact_t = xc @ g.T + b, xt @ g.T + b  # (tokens, n)
    fire = exact_t > 0
    rows = []
    for k in bits:
        gs = sketch(g, k)
        sd = (xc @ gs.T + b - exact_c).std(0)  # (n,) the sketch's error on calibration tokens
        approx = xt @ gs.T + b
        for m in margins:
            cand = approx + m * sd > 0
            rows.append({"bits": k, "margin_sd": m, "candidates": float(cand.mean()),
                         "recall": float((cand & fire).sum() / fire.sum()),
                         "gate_bytes_read": k / 4.5 + float(cand.mean())})  # of the exact Q4_0 gate's bytes
    return {"d": d, "neurons": n, "fires": float(fire.mean()), "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    from bench.record import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    fig = measure()
    print(f"firing {fig['fires']:.3f}")
    for r in fig["rows"]:
        print(f"{r['bits']} bits, margin {r['margin_sd']} sd: candidates {r['candidates']:.3f}, recall "
              f"{r['recall']:.5f}, gate bytes read {r['gate_bytes_read']:.2f} of the exact gate's")
    if a.out:
        write_result(a.out, fig)
    return fig


if __name__ == "__main__":
    main()
