"""Every GGUF tensor type gguf-py de-quantizes loads, in any mix (weights/formats.py's table, weights/quants.py and
quants_iq.py's de-quantizers, the conversion at load into a format the kernels read).

De-quantization is held to gguf.quants.dequantize bit for bit on fresh random blocks (F64 and Q8_K, which gguf-py does
not de-quantize, to float64 numpy); a conversion to the nearest format to gguf.quants' own de-quantize + quantize,
byte for byte. Tiny LLaMA files that mix types as llama.cpp's Q4_K_M, IQ4_XS and IQ3_M files do (row lengths that are
no multiple of 256 fall back to 32-blocks) load into the runtime with no flag, give HF's logits on gguf-py's
de-quantized weights within the conversions' rounding, and go through pi-profile, pi-solve, pi-generate and
pi-serve's loader."""

import json
import warnings

import gguf
import numpy as np
import pandas as pd
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hotneurons.weights.formats import (
    FORMATS,
    GPU_DTYPES,
    WeightFormat,
    from_ggml_type,
    kernel_format,
    nearest,
    row_bytes,
    spec,
)
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.quants import convert, dequantize

F = WeightFormat
GGUF_TYPES = [f for f, s in FORMATS.items() if s.ggml_type is not None]
BLOCK_TYPES = [f for f in GGUF_TYPES if FORMATS[f].block > 1]
# byte offsets of each block's fp16 scale fields, which random bytes could make inf or NaN
F16_FIELDS = {F.Q4_0: (0,), F.Q4_1: (0, 2), F.Q5_0: (0,), F.Q5_1: (0, 2), F.Q8_0: (0,), F.Q2_K: (80, 82),
              F.Q3_K: (108,), F.Q4_K: (0, 2), F.Q5_K: (0, 2), F.Q6_K: (208,), F.IQ2_XXS: (0,), F.IQ2_XS: (0,),
              F.IQ2_S: (0,), F.IQ3_XXS: (0,), F.IQ3_S: (0,), F.IQ1_S: (0,), F.IQ4_NL: (0,), F.IQ4_XS: (0,),
              F.TQ1_0: (52,), F.TQ2_0: (64,)}
# per format, the scale that makes its weights about 1 in size (the largest index times scale bits), for the models
UNIT = {F.Q4_0: 1 / 4, F.Q4_1: 1 / 4, F.Q5_0: 1 / 8, F.Q5_1: 1 / 8, F.Q8_0: 1 / 64, F.Q2_K: 1 / 12, F.Q3_K: 1 / 64,
        F.Q4_K: 1 / 40, F.Q5_K: 1 / 80, F.Q6_K: 1 / 2000, F.Q8_K: 1 / 64, F.IQ2_XXS: 1 / 20, F.IQ2_XS: 1 / 20,
        F.IQ2_S: 1 / 20, F.IQ3_XXS: 1 / 120, F.IQ3_S: 1 / 200, F.IQ1_S: 1 / 8, F.IQ1_M: 1 / 8, F.IQ4_NL: 1 / 64,
        F.IQ4_XS: 1 / 1000, F.TQ1_0: 1.0, F.TQ2_0: 1.0, F.MXFP4: 1 / 6, F.NVFP4: 1 / 6}
# the affine formats' min fields, per scale: the levels then straddle zero (w = d q - m)
CENTER = {F.Q4_1: -7.5, F.Q5_1: -15.5, F.Q2_K: 1.5, F.Q4_K: 7.5, F.Q5_K: 15.5}


def finite_f16(rng, n: int) -> np.ndarray:
    """n random finite fp16 bit patterns (subnormals, zeros and both signs included), as (n, 2) bytes."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    return np.where(bits & 0x7C00 == 0x7C00, bits ^ 0x0400, bits).astype(np.uint16).view(np.uint8).reshape(n, 2)


def f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float16).reshape(-1).view(np.uint8).reshape(-1, 2)


def valid_blocks(rng, fmt: WeightFormat, n: int, scale: float | None = None) -> np.ndarray:
    """(n, block bytes) uint8 of `fmt`: random bytes whose scale fields hold random finite values (scale None), or
    (a model's weights) scales for weights of about `scale` in size, the affine formats' levels centred on zero."""
    s = FORMATS[fmt]
    b = rng.integers(0, 256, (n, s.block_bytes), dtype=np.uint8)
    d = None if scale is None else scale * UNIT[fmt] * rng.uniform(0.5, 1.5, n).astype(np.float32)  # (n,)
    if fmt in CENTER and d is not None:
        v = rng.integers(1, 16, (n, 1), dtype=np.uint8)  # one 4-bit scale and min for every sub-block
        if fmt == F.Q2_K:
            b[:, :16] = v | (v << 4)
        elif fmt in (F.Q4_K, F.Q5_K):
            b[:, 4:12], b[:, 12:16] = v, v | (v << 4)
    for i, at in enumerate(F16_FIELDS.get(fmt, ())):
        if d is None:
            b[:, at:at + 2] = finite_f16(rng, n)
        else:
            b[:, at:at + 2] = f16_bytes(d if i == 0 else (-d if fmt in (F.Q4_1, F.Q5_1) else d) * CENTER[fmt])
    if fmt == F.Q8_K:  # a float32 scale
        b[:, :4] = (rng.standard_normal(n).astype(np.float32) if d is None else d).view(np.uint8).reshape(n, 4)
    elif fmt == F.IQ1_M:  # the fp16 scale's 4 nibbles are the top nibbles of the 4 uint16 at bytes 48-55
        bits = (finite_f16(rng, n) if d is None else f16_bytes(d)).view(np.uint16)[:, 0]  # (n,)
        sc = b[:, 48:56].copy().view(np.uint16)  # (n, 4)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = sc.view(np.uint8)
    elif fmt == F.MXFP4 and d is not None:  # e8m0: the scale is 2^(e - 128)
        b[:, 0] = np.clip(np.round(np.log2(d)) + 128, 1, 254).astype(np.uint8)
    elif fmt == F.NVFP4 and d is not None:  # ue4m3 bytes 0x38 (0.5) give weights of up to 3
        b[:, :4] = 0x38
    return b


def random_rows(rng, fmt: WeightFormat, rows: int, cols: int, scale: float | None = None) -> np.ndarray:
    """(rows, row_bytes) uint8 rows of `fmt` (valid_blocks), or a float format's finite values."""
    if FORMATS[fmt].block == 1:
        dt = {F.F32: np.float32, F.F16: np.float16, F.F64: np.float64}.get(fmt)
        x = rng.standard_normal((rows, cols)) * (1.0 if scale is None else scale)
        if dt is None:  # bf16: float32's top half
            return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return x.astype(dt).view(np.uint8).reshape(rows, -1)
    return valid_blocks(rng, fmt, rows * cols // FORMATS[fmt].block, scale).reshape(rows, row_bytes(fmt, cols))


def reference(b: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """gguf-py's de-quantization; float64 numpy for the two types it lacks (exact products, rounded once)."""
    if fmt == F.F64:
        return b.view(np.float64).astype(np.float32)
    if fmt == F.Q8_K:
        blocks = b.reshape(-1, 292)
        w = blocks[:, 4:260].view(np.int8).astype(np.float64) * blocks[:, :4].copy().view(np.float32).astype(np.float64)
        return w.astype(np.float32).reshape(b.shape[0], -1)
    return gguf.quants.dequantize(b, Q(FORMATS[fmt].ggml_type)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# The table


def test_table_holds_every_type_gguf_py_dequantizes():
    """Every type gguf-py de-quantizes (its ints aside) is a format here, with gguf-py's block sizes; each converts
    into a format both devices' kernels read; the others are refused in one line naming the type."""
    theirs = set()
    for t in Q:
        block, nbytes = gguf.GGML_QUANT_SIZES[t]
        try:
            gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), t)
        except (NotImplementedError, ValueError):
            continue
        if t.name.startswith("I") and not t.name.startswith("IQ"):
            continue  # I8 ... I64: integer tensors (PowerInfer's GPU masks), no weights
        theirs.add(t)
    assert theirs <= {Q(s.ggml_type) for s in FORMATS.values() if s.ggml_type is not None}
    for f in GGUF_TYPES:
        s = FORMATS[f]
        assert (s.block, s.block_bytes) == gguf.GGML_QUANT_SIZES[Q(s.ggml_type)] and from_ggml_type(s.ggml_type) == f
        to = nearest(f)
        assert FORMATS[to].cpu_kernel or to in (F.F32, F.F16), f  # the CPU: its kernels, or torch's floats
        assert str(to) in GPU_DTYPES, f
        if not FORMATS[f].gpu_kernel and FORMATS[f].block > 1:
            assert kernel_format(f, "cuda") == to and kernel_format(f, "cuda:1") == to
        assert FORMATS[to].bits_per_weight >= min(s.bits_per_weight, 8.5)  # no coarser grid than the source's
    assert kernel_format(F.Q4_0, "cpu") == F.Q4_0 and kernel_format(F.F16, "cpu") == F.F16
    assert (nearest(F.Q4_K), nearest(F.Q6_K), nearest(F.Q5_0), nearest(F.IQ4_XS), nearest(F.Q3_K)) == (
        F.Q4_1, F.Q8_0, F.Q8_0, F.Q8_0, F.Q4_0)
    with pytest.raises(ValueError, match="GGUF tensor type Q1_0 is not read") as e:
        from_ggml_type(Q.Q1_0)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="number 999"):
        from_ggml_type(999)


# ---------------------------------------------------------------------------------------------------------------
# De-quantization and conversion, every type


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf-py's MXFP4 at its largest scales
@pytest.mark.parametrize("fmt", GGUF_TYPES, ids=str)
def test_dequantize_equals_gguf_py(fmt, monkeypatch):
    """Random valid rows (odd count, partial last chunk, a lone 1-D row, rows at an odd address): ours == gguf-py's,
    bit for bit (assert_array_equal: equal floats, infs where both overflow)."""
    from hotneurons.weights import quants

    rng = np.random.default_rng(1000 + list(F).index(fmt))
    cols = 2 * max(FORMATS[fmt].block, 32)
    b = random_rows(rng, fmt, 7, cols)  # (7, row bytes)
    ref = reference(b, fmt)  # (7, cols)
    assert np.isfinite(ref).mean() > 0.9
    monkeypatch.setattr(quants, "_CHUNK_FLOATS", 2 * cols + 1)
    ours = dequantize(torch.from_numpy(b), fmt, cols)
    assert ours.dtype == torch.float32 and ours.shape == (7, cols)
    np.testing.assert_array_equal(ours.numpy(), ref)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(b[3]), str(fmt), cols).numpy(), ref[3])
    flat = torch.zeros(b.size + 1, dtype=torch.uint8)
    flat[1:] = torch.from_numpy(b).reshape(-1)
    np.testing.assert_array_equal(dequantize(flat[1:].view(7, -1), fmt, cols).numpy(), ref)


@pytest.mark.parametrize("fmt", [f for f in GGUF_TYPES if nearest(f) != f], ids=str)
def test_conversion_to_nearest_equals_gguf_py(fmt):
    """A type no kernel reads, converted at load: the bytes gguf-py's quantize writes for gguf-py's de-quantized
    weights, chunk by chunk (models/common._pack, moe_rows.requantized)."""
    rng = np.random.default_rng(2000 + list(F).index(fmt))
    cols = 2 * max(FORMATS[fmt].block, 32)
    b = random_rows(rng, fmt, 5, cols, scale=0.05)
    to = nearest(fmt)
    out = convert(QTensor(torch.from_numpy(b), fmt, (5, cols)), to)
    w = reference(b, fmt)  # (5, cols)
    if FORMATS[to].block == 1:
        assert out.dtype == torch.float32 and np.array_equal(out.numpy(), w)
        return
    assert isinstance(out, QTensor) and out.fmt == to and out.shape == (5, cols)
    want = gguf.quants.quantize(w, Q(FORMATS[to].ggml_type))
    np.testing.assert_array_equal(out.data.numpy(), want)
    assert spec(to).block_bytes / spec(to).block * cols * 5 == out.nbytes


def test_q4_k_to_q4_1_keeps_the_levels():
    """Q4_K's sub-blocks are q4_1 blocks up to the fp16 rounding of scale and min: where a sub-block uses its lowest
    and highest level (the rounding Q4_K's quantizer aims at), the conversion moves no weight by more than 2% of its
    step (fp16 keeps scale and min to 2^-11, times up to 15 levels), where q4_0's symmetric grid moves them by up to
    half a step."""
    rng = np.random.default_rng(3)
    b = valid_blocks(rng, F.Q4_K, 64, scale=0.05)
    qs = b[:, 16:].reshape(64, 4, 32)
    qs[:, :, 0], qs[:, :, 1] = 0x0F, 0xF0  # each sub-block: a 15 and a 0 (both nibbles)
    w = torch.from_numpy(reference(b, F.Q4_K)).reshape(-1, 256)  # (64, 256)
    q41 = convert(QTensor(torch.from_numpy(b), F.Q4_K, (64, 256)), F.Q4_1).dequantize()
    q40 = convert(QTensor(torch.from_numpy(b), F.Q4_K, (64, 256)), F.Q4_0).dequantize()
    sub = w.reshape(64, 8, 32)
    step = ((sub.amax(-1) - sub.amin(-1)) / 15).unsqueeze(-1)  # (64, 8, 1) each sub-block's level spacing
    assert float(((q41 - w).abs().reshape(64, 8, 32) / step).max()) < 0.02
    assert float(((q40 - w).abs().reshape(64, 8, 32) / step).max()) > 0.3


# ---------------------------------------------------------------------------------------------------------------
# Mixed files as llama.cpp writes them, read into the runtime

# per mix, the type of each tensor by its llama.cpp name (tensors not named: `rest`); the "small" shape's FFN has 704
# neurons, so ffn_down's rows (704 weights) are no whole 256-blocks and take a 32-block type, as llama.cpp falls back
MIXES = {
    "q4_k_m": {"token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_v": Q.Q6_K, "attn_k": Q.Q8_0, "blk.0.ffn_down": Q.Q5_0,
               "blk.1.ffn_down": Q.Q8_0, "rest": Q.Q4_K},
    "iq4_xs": {"output": Q.Q6_K, "ffn_down": Q.IQ4_NL, "attn_v": Q.Q5_K, "rest": Q.IQ4_XS},
    "iq3_m": {"token_embd": Q.IQ3_S, "output": Q.Q6_K, "attn_v": Q.Q4_K, "attn_k": Q.IQ2_S, "ffn_gate": Q.Q3_K,
              "ffn_up": Q.IQ3_XXS, "ffn_down": Q.IQ4_NL, "rest": Q.IQ3_S},
}


def mix_type(mix: dict, name: str) -> Q:
    for key in sorted(mix, key=len, reverse=True):  # the most specific key first
        if key != "rest" and (name.startswith(key + ".") or f".{key}." in name):
            return mix[key]
    return mix["rest"]


def write_mix(path, mix: dict, seed: int = 0):
    """The bench's "small" SwiGLU LLaMA (d 256, 704 neurons, 2 layers, vocab 1024, byte tokenizer) with random
    valid blocks of each tensor's type (weights of std ~0.02, embedding ~1 so that tokens differ), norms F32."""
    from hotneurons.bench import memory_models as mm
    from hotneurons.export.gguf_model import llama_metadata, vocab_from_tokenizer

    s = mm.SHAPES["small"]
    tok = mm.tokenizer(s.vocab)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    llama_metadata(w, mm.config(s, tok, "silu"), path.stem, activation="swiglu")
    vocab_from_tokenizer(tok, s.vocab).add_to(w)
    for t in mm.tensor_plan(s):
        if t.norm:
            w.add_tensor(t.gguf, (1 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32))
            continue
        fmt = from_ggml_type(mix_type(mix, t.gguf))
        scale = 1.0 if t.gguf == "token_embd.weight" else 0.06
        w.add_tensor(t.gguf, random_rows(rng, fmt, t.shape[0], t.shape[1], scale), raw_dtype=Q(FORMATS[fmt].ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixes")
    return {name: write_mix(folder / f"tiny-{name}.gguf", mix, seed) for seed, (name, mix) in enumerate(MIXES.items())}


def layout_weights(lm, rt, source, placement, device: str = "cpu") -> None:
    """Replace the HF model's weights by what the runtime computes with: attention and head as converted at load
    (weights.quants.convert to kernel_format; an untied embedding is read as stored), each FFN's hot and cold rows
    widened back from the layout (down's columns of hot neurons, down_t rows of cold ones)."""
    from hotneurons.weights.names import NameMap

    names = NameMap(lm.model.config.model_type, lm.info["n_layers"])
    with torch.no_grad():
        for hf, p in lm.model.named_parameters():
            canon = names(hf)
            if p.dim() < 2 or canon is None or ".ffn_" in canon or canon == "token_embd.weight":
                continue
            w = source.get(canon)  # q, k rows in HF's order (a row gather: it commutes with a row-wise conversion)
            to = kernel_format(w.fmt, device)
            p.copy_((w if to == w.fmt else convert(w, to)).dequantize())
        for i, (layer, f) in enumerate(zip(lm.layers, rt.ffns)):
            mods = lm.adapter.layer_ffn(layer)
            hot = torch.from_numpy(np.flatnonzero(placement.gpu[i]))
            cold = torch.from_numpy(np.flatnonzero(~placement.gpu[i]))
            rows = f.cold.float32()
            for name in ("gate", "up"):
                mods[name].weight[cold] = rows[name]
                mods[name].weight[hot] = f.hot_q[name].dequantize().cpu()
            down = mods["down"].weight  # (d, n)
            down[:, cold] = rows["down_t"].T
            down[:, hot] = f.hot_q["down"].dequantize().cpu()[:, :len(hot)]


@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_file_equals_hf_on_gguf_py_weights(mix, mixed_files):
    """Read with no flag (a random half of each layer's neurons hot, dense mask): every tensor in its stored type, the
    converted ones named in one notice; logits equal to HF's model (transformers' GGUF loader: gguf-py's de-quantized
    weights) on the weights the layout holds, and within the conversions' rounding of HF's on the file's own."""
    from hotneurons.artifacts.placement import Placement
    from hotneurons.models.family import load_model
    from hotneurons.runtime.config import RuntimeConfig
    from hotneurons.runtime.engine import load_source_runtime
    from hotneurons.runtime.generate import generate
    from hotneurons.weights.source import open_source

    path = mixed_files[mix]
    types = {t.name: from_ggml_type(mix_type(MIXES[mix], t.name)) for t in gguf.GGUFReader(str(path)).tensors
             if len(t.shape) == 2}  # every matrix: the type the mix gives it
    lm = load_model(str(path), device="cpu", dtype="float32", cache=False)
    L, n = lm.info["n_layers"], lm.info["n_neurons"]
    placement = Placement(tuple(np.random.default_rng(i).random(n) < 0.5 for i in range(L)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = load_source_runtime(None, None, RuntimeConfig(mode="dense", device="cpu"), model=str(path),
                                 placement=placement)
    notes = [str(w.message) for w in caught if "converted at load" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    for f in set(types.values()):
        if kernel_format(f, "cpu") != f:  # each type no CPU kernel reads named, with what it becomes
            assert f"{str(f).upper()} -> " in notes[0], (f, notes[0])
    assert rt.cfg.cold_dtype == rt.cfg.gpu_dtype == str(kernel_format(types["blk.0.ffn_up.weight"], "cpu"))
    ids = list(lm.tokenizer("The quick brown fox jumps")["input_ids"])
    with torch.no_grad():
        file_logits = lm.model(torch.tensor([ids])).logits[0, -1].float()  # (vocab,)
        with open_source(path) as src:
            assert {name: src.info(name).fmt for name in types} == types
            layout_weights(lm, rt, src, placement)
        want = lm.model(torch.tensor([ids])).logits[0, -1].float()
    ours = generate(rt, ids, 1, stop_at_eos=False, keep_logits=True).logits[0].float()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, want, rtol=0, atol=2e-4 * float(want.abs().max()))  # float32 sums' order
    # the conversions' own cost, against the file's unconverted weights: the logits stay correlated above 0.97 (the
    # Q4_K and IQ3 mixes: their FFN down rows, Q5_0 / Q8_0 / IQ4_NL, kept in the FFN's one 4-bit format), above
    # 0.999 where every conversion is to q8_0 (the IQ4_XS mix); unrelated random models' are uncorrelated
    corr = float(torch.corrcoef(torch.stack([ours, file_logits]))[0, 1])
    assert corr > (0.999 if mix == "iq4_xs" else 0.97), corr


def test_mixed_file_through_the_commands(mixed_files, text_corpus, tmp_path):
    """pi-profile, pi-solve, pi-generate and pi-serve's loader on the Q4_K_M-like file, with no format flag."""
    from click.testing import CliRunner
    from hotneurons.profiler.cli import main as profile
    from hotneurons.runtime.cli import main as generate_main
    from hotneurons.runtime.cli import open_runtime
    from hotneurons.server.cli import main as serve_main
    from hotneurons.solver.cli import main as solve

    run = tmp_path / "run"
    path = mixed_files["q4_k_m"]
    for cmd, args in ((profile, ["--model", str(path), "--dataset", str(text_corpus), "--tokens", "512",
                                 "--seq-len", "64", "--samples-per-layer", "0", "--calibration-tokens", "256",
                                 "--out", str(run), "--device", "cpu", "--quiet"]),
                      (solve, ["--run", str(run), "--hardware", "rtx4090", "--vram", "3MB", "--reserve", "0",
                               "--ctx", "128"]),
                      (generate_main, ["--run", str(run), "--device", "cpu", "-n", "4", "--prompt", "The quick",
                                       "--json"])):
        res = CliRunner().invoke(cmd, args)
        assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4
    flags = serve_main.make_context("pi-serve", ["--run", str(run), "--device", "cpu", "--port", "0"]).params
    serving = ("host", "port", "api_key", "max_queue", "timeout", "max_tokens", "model_id", "quiet")
    rt = open_runtime(**{k: v for k, v in flags.items() if k not in serving})
    assert rt.cfg.cold_dtype == "q4_k" and rt.cfg.gpu_dtype == "q4_k"  # the file's Q4_K rows, as stored
    gpu = pd.read_parquet(run / "placement" / "placement.parquet")["gpu"]
    assert 0 < gpu.mean() < 1 and rt.bytes_cpu > 0  # a hybrid split: hot rows on the device, cold ones in CPU RAM


# ---------------------------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_dequantize_equals_gguf_py():
    """Every type de-quantized on the device (its tables moved there): gguf-py's floats, bit for bit."""
    for fmt in GGUF_TYPES:
        rng = np.random.default_rng(3000 + list(F).index(fmt))
        cols = 4 * max(FORMATS[fmt].block, 32)
        b = random_rows(rng, fmt, 33, cols, scale=0.05)
        ours = dequantize(torch.from_numpy(b).cuda(), fmt, cols)
        assert ours.is_cuda, fmt
        np.testing.assert_array_equal(ours.cpu().numpy(), reference(b, fmt), err_msg=str(fmt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mix", list(MIXES))
def test_on_cuda_mixed_file_equals_the_cpu_run(mix, mixed_files):
    """The mixes on CUDA in float32 (attention and head converted on the device and packed for the Triton GEMV, hot
    rows there, cold ones on the CPU): the CPU run's logits (itself held to HF's above), the same placement."""
    from hotneurons.artifacts.placement import Placement
    from hotneurons.runtime.config import RuntimeConfig
    from hotneurons.runtime.engine import load_source_runtime
    from hotneurons.runtime.generate import generate

    path = mixed_files[mix]
    placement = Placement(tuple(np.random.default_rng(i).random(704) < 0.5 for i in range(2)))  # "small": 2 x 704
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products on both sides
    logits = []
    for device in ("cpu", "cuda"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rt = load_source_runtime(None, None, RuntimeConfig(mode="dense", device=device, dtype="float32"),
                                     model=str(path), placement=placement)
        ids = list(rt.lm.tokenizer("The quick brown fox jumps")["input_ids"])
        logits.append(generate(rt, ids, 1, stop_at_eos=False, keep_logits=True).logits[0].float().cpu())
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-3 * float(logits[0].abs().max()))
