"""What an exact expert predictor saves on one Mixtral-sized sparse expert (bench/moe_gguf.py's construction, on the
CPU): a gate of rank 32 (n 14,336, d 4,096) with its bias calibrated as the sparse variant's (gate > 0 with
probability p_j / 0.8, p a power law of mean 0.15), stored in Q4_0; its exact predictor of rank 33 with the build's
thresholds (moe_gguf._predictor, fitted on one set of inputs); recall and the share of neurons marked on another set
(unit-normal inputs, channel 0 the constant 1); and the bytes a token reads of the expert with and without it.

    python -m bench.expert_predictor_bytes --out bench/results/<date>-cpu-expert-predictor-bytes.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

UP_POSITIVE_SHARE = 0.8  # moe_gguf.UP_POSITIVE: up > 0 for this share of tokens, independent of the gate


def measure(n: int = 14336, d: int = 4096, rank: int = 32, tokens: int = 768, seed: int = 0) -> dict:
    import torch

    from bench.moe_gguf import STD, _predictor, _q4, gate_fire_probs, set_bias

    g = torch.Generator().manual_seed(seed)

    def inputs() -> torch.Tensor:
        x = torch.randn((tokens, d), generator=g)
        x[:, 0] = 1.0  # the constant channel, as the bench model's FFN inputs carry it
        return x

    row = d // 32 * 18  # bytes of one Q4_0 row
    fit, held = inputs(), inputs()
    af = torch.randn((rank, d - 1), generator=g) * (STD / rank ** 0.5)
    bf = torch.randn((n, rank), generator=g)
    gate = torch.zeros((n, d))
    gate[:, 1:] = bf @ af
    set_bias(gate, fit, gate_fire_probs(n, seed + 3))
    _, stored = _q4(gate)
    A, B, thr, fit_recall, fit_marked = _predictor(af, bf, gate[:, 0], stored, fit)
    score = (held @ torch.from_numpy(A).T) @ torch.from_numpy(B).T  # (tokens, n)
    marked, fires = score > torch.from_numpy(thr), held @ stored.T > 0
    share = {"marked": float(marked.float().mean()), "gate_fires": float(fires.float().mean())}
    fired = share["gate_fires"] * UP_POSITIVE_SHARE  # relu(gate) * relu(up) != 0
    pred_bytes = 4 * (A.size + B.size + thr.size)  # float32, as runtime/expert_predictors.py keeps them
    whole = n * row * (1 + share["gate_fires"] + fired)  # every gate row, up where the gate fires, down_t of fired
    predicted = pred_bytes + n * row * (share["marked"] + share["gate_fires"] + fired)
    return {"n": n, "d": d, "gate_rank": rank, "predictor_rank": rank + 1, "tokens": tokens,
            "fit": {"recall": fit_recall, "marked": fit_marked},
            "held_out": {"recall": float((marked & fires).sum() / fires.sum()), **share},
            "bytes_per_token": {"expert_dense": 3 * n * row, "gate_rows_whole": whole,
                                "with_predictor": predicted, "predictor": pred_bytes},
            "fewer_bytes": whole / predicted}


def main(argv: list[str] | None = None) -> dict:
    from bench.record import write_result

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank", type=int, default=32)
    a = p.parse_args(argv)
    fig = measure(rank=a.rank)
    b = fig["bytes_per_token"]
    print(f"held-out recall {fig['held_out']['recall']:.4f}, marked {fig['held_out']['marked']:.3f} (gate fires "
          f"{fig['held_out']['gate_fires']:.3f}); a routed cold expert reads {b['with_predictor'] / 1e6:.1f} MB with "
          f"its predictor against {b['gate_rows_whole'] / 1e6:.1f} MB ({fig['fewer_bytes']:.2f}x fewer)")
    write_result(a.out, fig)
    return fig


if __name__ == "__main__":
    main()
