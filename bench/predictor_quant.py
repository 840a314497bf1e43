"""Predictors in fewer bytes: what recall, precision and predicted sparsity each storage keeps, and what the bytes it
frees buy on the 70B shape.

1. Quality, on a run's trained predictors (the normed form) and its profile's held-out samples: per layer, fc1 and
   fc2 rounded to llama.cpp's Q8_0 or Q4_0 blocks (32 weights along the input; gguf.quants, the reference de-
   quantizer) against the weights as stored. Each storage gets its own threshold, set on the val rows for the run's
   target recall, and is scored on the test rows (predictors/train.split_indices: the training's own split); the
   stored threshold's drift is reported too (test recall and precision at the threshold trained for the stored
   weights).
2. Bytes: each storage's bytes for the run and for the 70B shape's predictors (hidden 1024: 6.04 GB as fp16).
3. What they buy: pi-solve's cost model on its synthetic LLaMA-2-70B profile (solver/synthetic.py), 24 GiB, Q4_0,
   ctx 4096, reserve 2.75 GB (bench_70b's settings), on the rtx4090 and h100 presets, with the predictors' bytes of
   each storage: hot neurons and the expected decode rate (a model figure, not a measurement; the GPU reads the
   predictors every token, so their bytes cost time as well as room).

    python -m bench.predictor_quant --run runs/demo --out bench/results/<date>-cpu-predictor-quant.json
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
import numpy as np

FORMATS = {"stored": None, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per weight (stored: the file's dtype)
D70, H70, N70, L70 = 8192, 1024, 28672, 80  # the 70B bench's predictors (bench_70b --gate-rank 511)


def rounded(w, fmt: str):
    """w (rows, cols) float32 -> the same rounded through `fmt`'s blocks along cols (zero-padded to 32)."""
    import torch
    from gguf import GGMLQuantizationType, quants

    a = w.float().numpy()
    pad = (-a.shape[1]) % 32
    if pad:
        a = np.pad(a, ((0, 0), (0, pad)))
    t = GGMLQuantizationType[fmt.upper()]
    back = quants.dequantize(quants.quantize(a, t), t)  # (rows, cols + pad)
    return torch.from_numpy(np.ascontiguousarray(back[:, :w.shape[1]]))


def quality(run: Path, max_layers: int | None = None) -> dict:
    import torch
    from hotneurons.artifacts.predictor_file import load_predictors
    from hotneurons.artifacts.predictors import PredictorForm
    from hotneurons.artifacts.profile import read_profile
    from hotneurons.predictors.fit import metrics, threshold_for_recall
    from hotneurons.predictors.train import load_samples, samples_dir, split_indices

    _, meta = read_profile(run)
    preds = load_predictors(run)
    if preds.form != PredictorForm.NORMED:
        raise click.UsageError(f"{run}'s predictors are of the {preds.form} form: this study reads the profile's FFN "
                               f"inputs, which the normed form reads; train with --form normed")
    cfg = preds.meta.config
    recall = float(cfg["target_recall"])
    split = type("Split", (), {k: cfg[k] for k in ("seed", "val_fraction", "test_fraction")})
    n = meta.model["n_neurons"]
    sdir = samples_dir(run, meta)
    layers = sorted(preds.layers)[:max_layers]
    rows: dict[str, list] = {f: [] for f in FORMATS}
    stored_bytes = 0
    for i in layers:
        p = preds.layers[i]
        x, m = load_samples(sdir, i, n)  # (count, d), (count, n)
        _, val, test = split_indices(len(x), split)
        w1, w2 = p.fc1.weight.detach().float(), p.fc2.weight.detach().float()  # (h, d), (n, h)
        stored_bytes += sum(int(w.numel()) * 2 for w in (w1, w2))  # fp16 in predictors.safetensors
        for fmt in FORMATS:
            a, b = (w1, w2) if fmt == "stored" else (rounded(w1, fmt), rounded(w2, fmt))
            with torch.no_grad():
                lv, lt = (torch.relu(x[s] @ a.T) @ b.T for s in (val, test))  # (rows, n) logits
            own = threshold_for_recall(lv, m[val], recall)
            rows[fmt].append({"layer": i, "threshold": own, "test": metrics(lt, m[test], own),
                              "test_at_stored_threshold": metrics(lt, m[test], float(p.threshold))})
    out: dict = {"run": str(run), "layers": len(layers), "target_recall": recall, "hidden": [
        int(preds.layers[i].fc1.weight.shape[0]) for i in layers], "stored_bytes": stored_bytes, "formats": {}}
    for fmt, rs in rows.items():
        mean = {k: float(np.mean([r["test"][k] for r in rs])) for k in ("recall", "precision", "predicted_sparsity")}
        drift = {k: float(np.mean([r["test_at_stored_threshold"][k] for r in rs])) for k in ("recall", "precision")}
        per_weight = FORMATS[fmt] or 2.0
        out["formats"][fmt] = {"bytes": int(stored_bytes / 2 * per_weight), "test_mean": mean,
                               "test_mean_at_stored_threshold": drift, "layers": rs}
    return out


def bytes_70b(per_weight: float, hidden: int = H70) -> int:
    return int(L70 * (hidden * D70 + N70 * hidden) * per_weight)


def what_it_buys(storages: dict[str, int], hardware: tuple[str, ...] = ("rtx4090", "h100"),
                 tokens: int = 100_000) -> dict:
    """pi-solve's expectation on its synthetic 70B profile, per hardware preset and predictor bytes."""
    from hotneurons.common.hardware import get_hardware
    from hotneurons.common.units import parse_bytes
    from hotneurons.solver import solve_placement
    from hotneurons.solver.synthetic import write_synthetic_profile

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        write_synthetic_profile(run, "llama-70b", tokens=tokens)
        for hw in hardware:
            for name, nbytes in storages.items():
                s = solve_placement(run, get_hardware(hw), parse_bytes("24GiB"), dtype="q4_0", cold_dtype="q4_0",
                                    ctx=4096, reserve_bytes=parse_bytes("2.75GB"), write=False,
                                    predictor_bytes=nbytes)
                out.setdefault(hw, {})[name] = {
                    "predictor_bytes": nbytes, "gpu_neuron_share": s.gpu_neuron_share,
                    "gpu_activation_share": s.gpu_activation_share, "expected_tokens_per_s": s.expected_tokens_per_s}
                click.echo(f"70B on {hw}, predictors {name} ({nbytes / 1e9:.2f} GB): {s.gpu_neuron_share:.3f} of "
                           f"neurons hot, {s.gpu_activation_share:.3f} of firings, expected "
                           f"{s.expected_tokens_per_s:.1f} tok/s")
    return out


@click.command()
@click.option("--run", "run_dir", type=click.Path(path_type=Path, exists=True), default=Path("runs/demo"),
              show_default=True, help="A run with profile samples and trained predictors (make demo).")
@click.option("--layers", type=int, default=None, help="Only the first N layers (default: all).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The results file (JSON).")
def main(run_dir: Path, layers: int | None, out: Path) -> None:
    from bench.record import write_result

    q = quality(run_dir, layers)
    for fmt, r in q["formats"].items():
        t, d = r["test_mean"], r["test_mean_at_stored_threshold"]
        click.echo(f"{fmt:6s} {r['bytes'] / 1e6:7.2f} MB: test recall {t['recall']:.4f} precision {t['precision']:.4f} "
                   f"predicted sparsity {t['predicted_sparsity']:.4f} (at the stored threshold: recall "
                   f"{d['recall']:.4f}, precision {d['precision']:.4f})")
    storages = {"fp16": bytes_70b(2.0), "q8_0": bytes_70b(34 / 32), "q4_0": bytes_70b(18 / 32),
                "fp16, hidden 512": bytes_70b(2.0, H70 // 2)}
    write_result(out, {"quality": q, "llama70b": what_it_buys(storages)})
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
