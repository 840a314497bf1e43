"""Export a run for another runtime (`pi-export`). See docs/export.md.

Two layers, so that a benchmark can export a model it holds in memory and the CLI a run directory:

    write_powerinfer(model, vocab: Vocab, predictors: Sequence[tuple[Tensor, Tensor]], threshold: float,
                     counts: Sequence[np.ndarray], gpu_mask: Sequence[np.ndarray] | None, vram_capacity: int,
                     out: str | Path, *, config=None, activation: str | None = None, name: str = "model",
                     force: bool = False, progress: bool = False, info: dict | None = None) -> dict
        model: an HF LLaMA causal LM (any device, any dtype) or its state dict (HF names) with `config`;
        vocab: `vocab_from_tokenizer(tokenizer, config.vocab_size)` or `placeholder_vocab(n)`;
        predictors: per layer (fc1 (r, d), fc2 (n_ff, r)) in PowerInfer's form (pre-norm input, no biases);
        threshold: PowerInfer's one sparse_threshold; counts: per layer (n_ff,) activation counts;
        gpu_mask: per layer (n_ff,) bool, True on the GPU (None: no .gpuidx); vram_capacity: bytes.
        Writes OUT/{name}.powerinfer.gguf, OUT/activation/activation_{i}.pt, OUT/{name}.powerinfer.gguf.generated.gpuidx
        and OUT/export.json; returns the summary.

    export_run(run_dir, out, *, fmt="powerinfer", recall: float | None = None, vram_capacity: int | None = None,
               model: str | None = None, dtype: str = "float32", force: bool = False, progress: bool = False) -> dict
        RUN/profile, RUN/predictors, RUN/placement (optional) and the run's model -> write_powerinfer.

    requantize(model, out, qtype, *, force=False, progress=False) -> dict
        A GGUF file copied to `out` with its weight matrices re-quantized to qtype (q4_0, q4_1, q8_0, f16, bf16, f32),
        streamed tensor by tensor; returns the summary (bytes in and out, tensors per format).

    exact_predictors(state: dict[str, Tensor], n_layers: int, form: str = "powerinfer") -> list[tuple[Tensor, Tensor]]
        A ReGLU LLaMA's exact predictors, threshold 0: fc1 = [W_gate·diag(γ); -W_gate·diag(γ)] (2 n_ff × d),
        fc2 = [I, -I] (n_ff × 2 n_ff); form "normed" leaves γ out (for a runtime feeding the post-norm input).
    write_predictors(run_dir, info: dict, layers, threshold: float, form: str = "powerinfer", name: str = "exact")
        -> Path: them (or any weights) as RUN/predictors, which pi-generate and pi-export read as trained ones.
    to_powerinfer(layers, thresholds: Sequence[float], form: str, gamma: Sequence[Tensor]) -> (layers, threshold)
        Trained predictors of either form -> PowerInfer's, or a one-line refusal (ExportError).
"""

import importlib

RUN_FORMATS = ("powerinfer",)  # pi-export --format, from a run directory (export_run)
FORMATS = (*RUN_FORMATS, "gguf")  # gguf: a model file copied with its matrices re-quantized (export/requantize.py)
QUANT_TYPES = ("q4_0", "q4_1", "q8_0", "f16", "bf16", "f32")  # --type: what weights/quants.quantize writes

_LAZY = {"ExportError": ".gguf_model", "Vocab": ".gguf_model", "placeholder_vocab": ".gguf_model",
         "vocab_from_tokenizer": ".gguf_model", "write_powerinfer": ".powerinfer", "exact_predictors": ".predictors",
         "to_powerinfer": ".predictors", "write_predictors": ".predictors", "export_run": ".run",
         "requantize": ".requantize"}  # on first use: the CLI's --help stays quick

__all__ = ["FORMATS", "QUANT_TYPES", "RUN_FORMATS", "ExportError", "Vocab", "export_run", "exact_predictors",
           "placeholder_vocab", "requantize", "to_powerinfer", "vocab_from_tokenizer", "write_powerinfer",
           "write_predictors"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
