"""--predictor-dtype q8_0: the predictors in llama.cpp's Q8_0 blocks, made at load (runtime/ffn_setup.predictor_blocks)
and read by qlinear's GEMVs, decide as predictors whose weights were rounded the same way beforehand (by gguf.quants,
the reference de-quantizer) and read as floats: the same greedy tokens and logits, hidden widths not a multiple of 32
padded with zero units; the path refused where its blocks could not follow the model."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch
from gguf import GGMLQuantizationType, quants
from hotneurons.artifacts.placement import Placement
from hotneurons.models.open import model_info, open_model
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import load_runtime, load_source_runtime

FAMILY = "llama-reglu"
PROMPT = [5, 17, 42, 9, 33, 2, 71]
HIDDEN = 24  # not a multiple of 32: padded at load


def _run(folder, path, tensors=None):
    path.mkdir(exist_ok=True)
    source, sid, _, act = open_model(str(folder))
    info = model_info(source, sid, act, "llama", True)
    tiny.write_predictors(path, info, 0.0, hidden=HIDDEN, tensors=tensors)
    return path, info


def _rounded(w: torch.Tensor, width: int) -> torch.Tensor:
    """w zero-padded to `width` columns, through Q8_0 and back (gguf.quants)."""
    a = np.pad(w.float().numpy(), ((0, 0), (0, width - w.shape[1])))
    t = GGMLQuantizationType.Q8_0
    return torch.from_numpy(quants.dequantize(quants.quantize(a, t), t).copy())


def _load(run, folder, info, dtype: str, device: str = "cpu"):
    cfg = RuntimeConfig(device=device, dtype="float32", cold_dtype="q4_0", predictor_dtype=dtype)
    gpu = tuple(np.random.default_rng(i).random(info["n_neurons"]) < 0.3 for i in range(info["n_layers"]))
    return load_source_runtime(run, None, cfg, model=str(folder), placement=Placement(gpu))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_q8_0_predictors_decide_as_rounded_floats(tiny_model_dir, tmp_path, device):
    """On CUDA the blocks are qlinear's GpuQ, read by its GEMV inside the step's graphs, the reference's floats by
    the fused predictor kernel."""
    folder = tiny_model_dir(FAMILY)
    run, info = _run(folder, tmp_path / "a")
    from safetensors.torch import load_file

    raw = load_file(str(run / "predictors" / "predictors.safetensors"))
    ref = {}
    for i in range(info["n_layers"]):  # the same predictors rounded beforehand, their hidden padded to 32
        fc1, fc2 = raw[f"layers.{i}.fc1.weight"].float(), raw[f"layers.{i}.fc2.weight"].float()
        ref[f"layers.{i}.fc1.weight"] = _rounded(torch.cat((fc1, fc1.new_zeros(32 - HIDDEN, fc1.shape[1]))),
                                                 fc1.shape[1])
        ref[f"layers.{i}.fc2.weight"] = _rounded(fc2, 32)
        ref[f"layers.{i}.threshold"] = raw[f"layers.{i}.threshold"]
    rounded, _ = _run(folder, tmp_path / "b", ref)
    q = _load(run, folder, info, "q8_0", device)
    f = _load(rounded, folder, info, "auto", device)
    assert not isinstance(q.ffns[0].pred_fc1, torch.Tensor) and q.ffns[0].pred_fc1.shape == (32, info["d_model"])
    gq = generate(q, PROMPT, 12, stop_at_eos=False, keep_logits=True)
    gf = generate(f, PROMPT, 12, stop_at_eos=False, keep_logits=True)
    assert gq.token_ids == gf.token_ids
    torch.testing.assert_close(torch.stack(gq.logits), torch.stack(gf.logits), rtol=0, atol=1e-4)
    marks = [ffn.cold_marks[1] for ffn in q.ffns]
    assert marks == [ffn.cold_marks[1] for ffn in f.ffns] and sum(marks) > 0  # the same cold neurons, token by token
    assert q.bytes_gpu < f.bytes_gpu  # blocks: 34 bytes a 32 weights against 128 as float32


def test_q8_0_predictors_refused_on_the_transformers_path(tiny_model_dir, tmp_path):
    folder = tiny_model_dir(FAMILY)
    run, _ = _run(folder, tmp_path / "a")
    cfg = RuntimeConfig(mode="dense", device="cpu", dtype="float32", predictor_dtype="q8_0", static_decode=False)
    with pytest.raises(ValueError, match="--predictor-dtype q8_0 runs on our decoders"):
        load_runtime(run, cfg, model=str(folder))  # static_decode off: the transformers path


def test_an_unknown_predictor_dtype_is_one_line():
    from hotneurons.runtime.ffn_setup import FFNLayout

    with pytest.raises(ValueError, match="unknown predictor dtype 'q4_0': choose one of auto, q8_0"):
        FFNLayout("predictor", "bf16", predictor_dtype="q4_0")
