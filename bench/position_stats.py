"""Does the bench model fire the same way at every position? Builds and calibrates pi_bench's model (bench_model.py)
on any device, then reports, per range of positions, the share of neurons that fire and the share of firings that
the hottest `--hot` of each layer's neurons (ranked on the whole profile, as pi-solve would) cover; and the same for
a greedy decode from pi_bench's prompt. CPU runs at a few layers of a large shape take minutes.

    python bench/position_stats.py --shape llama-2-7b --layers 3 --gate-rank 255 --embed-std 0.02 --out pos.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402

EDGES = (0, 16, 48, 128, 256, 512)


def fires(lm, ids: torch.Tensor) -> torch.Tensor:
    """(layers, tokens, neurons) float 0/1: relu(gate . x) > 0 for each token of ids (1, tokens)."""
    out = []
    bm.with_gate_outputs(lm, ids, lambda _i, o: out.append((o[0] > 0).float()))
    return torch.stack(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-2-7b", choices=list(bm.SHAPES))
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--gate-rank", type=int, default=None)
    ap.add_argument("--embed-std", type=float, default=bm.EMBED_STD)
    ap.add_argument("--seqs", type=int, default=2, help="profile sequences of 512 random tokens")
    ap.add_argument("--hot", type=float, default=0.08, help="share of each layer's neurons counted as hot")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    *_, vocab = bm.SHAPES[args.shape]
    lm = bm.build_model(args.shape, args.layers, args.device, gate_rank=args.gate_rank, embed_std=args.embed_std)
    if args.device == "cpu":
        lm.model.float()  # CPU fp16 matmuls are slow
    bm.calibrate(lm, args.shape, tokens=2048, seq=256)
    g = torch.Generator(args.device).manual_seed(5)
    prof = torch.stack([fires(lm, torch.randint(0, vocab, (1, EDGES[-1]), generator=g, device=args.device))
                        for _ in range(args.seqs)])  # (seqs, layers, positions, neurons)
    freq = prof.mean((0, 2))  # (layers, neurons)
    hot = torch.zeros_like(freq, dtype=torch.bool)
    hot.scatter_(1, freq.topk(int(args.hot * freq.shape[1]), 1).indices, True)

    def stats(f: torch.Tensor) -> dict:  # f (layers, tokens, neurons)
        share = ((f * hot[:, None]).sum((1, 2)) / f.sum((1, 2))).mean()
        return {"mean_active": float(f.mean()), "hot_share_of_firings": float(share)}

    rows = [{"positions": f"{a}-{b}", **stats(prof[:, :, a:b].transpose(0, 1).flatten(1, 2))}
            for a, b in zip(EDGES, EDGES[1:])]
    ids = torch.tensor([list(range(100, 116))], device=args.device) % vocab  # pi_bench's prompt
    for _ in range(args.decode_tokens):
        with torch.no_grad():
            nxt = lm.model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], 1)
    res = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "profile": stats(prof.transpose(0, 1).flatten(1, 2)), "by_position": rows,
           "greedy_decode": {**stats(fires(lm, ids)[:, 16:]), "tokens": ids[0, 16:].tolist()}}
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
