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
from blocks import random_rows, valid_blocks
from cold_ref import lay_out_ffns
from gguf import GGMLQuantizationType as Q
from hotneurons.weights.formats import (
    FORMATS,
    GPU_DTYPES,
    WeightFormat,
    from_ggml_type,
    kernel_format,
    nearest,
    spec,
)
from hotneurons.weights.qtensor import QTensor, convert
from hotneurons.weights.quants import dequantize

F = WeightFormat
GGUF_TYPES = [f for f, s in FORMATS.items() if s.ggml_type is not None]
BLOCK_TYPES = [f for f in GGUF_TYPES if FORMATS[f].block > 1]
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


def test_kernels_take_their_sizes_from_the_table():
    """The kernels' own size tables (Numba's tuples by format code, Triton's per-format arguments, the CPU blocks')
    are the table's numbers, and the command lines' format choices its names."""
    from hotneurons.kernels import cold_experts, cold_q, dequant, ir_util, qgemv, qlayout_k, qlinear
    from hotneurons.kernels.names import COLD_DTYPES
    from hotneurons.runtime.cli import _float_bytes
    from hotneurons.weights import quants_cpu

    for code, f in enumerate(ir_util.CODE_FORMATS):
        assert (ir_util.BLOCK_WEIGHTS[code], ir_util.BLOCK_BYTES[code]) == (spec(f).block, spec(f).block_bytes)
        assert cold_q.FORMAT_CODE[f.value] == code and cold_experts.CODE[f.value] == code
    q = ir_util  # each code names its format (the compiled kernels branch on the codes)
    assert [q.CODE_FORMATS[c] for c in (q.Q8_0, q.Q4_0, q.Q4_1, q.Q4_K, q.Q5_K, q.Q6_K)] == [
        F.Q8_0, F.Q4_0, F.Q4_1, F.Q4_K, F.Q5_K, F.Q6_K]
    for name, (block, nbytes) in quants_cpu.BLOCKS.items():
        assert (block, nbytes) == (spec(name).block, spec(name).block_bytes)
        assert quants_cpu.READS[quants_cpu._SRC[name]] == name
    for name, code in quants_cpu._DST.items():
        assert quants_cpu._DST_BYTES[code] == (0 if name == "f32" else spec(name).block_bytes)
    assert qlinear.QBLOCK == qgemv.QBLOCK == quants_cpu.QK == cold_q.BLOCK == spec(F.Q4_0).block
    for f in qlinear.BLOCKS:
        assert qlinear._head(f) + qlinear.BLOCKS[f] == spec(f).block_bytes and qlinear._head(f) in (2, 4)  # fp16 fields
    assert set(dequant.KERNEL_FORMATS) == set(qlinear.BLOCKS) and set(dequant.K_FORMATS) == set(qlayout_k.K_FORMATS)
    assert all(FORMATS[f].gpu_kernel for f in (*dequant.KERNEL_FORMATS, *dequant.K_FORMATS))
    assert set(COLD_DTYPES) == {str(f) for f, s in FORMATS.items() if s.cpu_kernel}
    assert [_float_bytes(n) for n in ("f16", "fp16", "float16", "bf16", "f32", "fp32", "float64", "q4_0", "auto")] == [
        2, 2, 2, 2, 4, 4, 8, None, None]


def test_no_module_types_block_bytes():
    """No module of the package holds a literal table of block bytes (a tuple, list, set or dict with two or more of
    the kernel formats' block bytes among its numbers, one level of nesting included): they come from the table."""
    import ast
    from pathlib import Path

    kernel_bytes = {s.block_bytes for s in FORMATS.values() if (s.cpu_kernel or s.gpu_kernel) and s.block > 1}
    assert kernel_bytes >= {18, 20, 34, 144, 176, 210}
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("tests", "runs") or any(p.startswith(".") for p in rel.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                continue
            items = [*node.keys, *node.values] if isinstance(node, ast.Dict) else node.elts
            items += [e for i in items if isinstance(i, ast.Tuple) for e in i.elts]
            ints = {i.value for i in items if isinstance(i, ast.Constant) and type(i.value) is int}
            if len(ints & kernel_bytes) >= 2:
                found.append(f"{rel}:{node.lineno} {sorted(ints & kernel_bytes)}")
    assert not found, f"block bytes typed outside weights/formats.py: {found}"


def test_gguf_numbers_are_gguf_pys():
    """The GGUF reader's value types are gguf-py's (each scalar's width its writer's), and a layer's tensor names its
    TENSOR_NAMES'."""
    import struct

    from hotneurons.weights import gguf_file
    from hotneurons.weights.names import layer_name

    packing = gguf.GGUFWriter._simple_value_packing
    assert set(gguf_file._SCALARS) == {int(t) for t in packing}
    for t, fmt in packing.items():
        assert np.dtype(gguf_file._SCALARS[t]) == np.dtype(fmt) and np.dtype(fmt).itemsize == struct.calcsize(fmt)
    assert (gguf_file._STRING, gguf_file._ARRAY) == (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)
    assert {np.dtype(dt).itemsize for dt in gguf_file.INTS.values()} == {1, 2, 4, 8}
    for t, dt in gguf_file.INTS.items():
        assert gguf.GGML_QUANT_SIZES[Q(t)] == (1, np.dtype(dt).itemsize)
    T = gguf.MODEL_TENSOR
    for t in (T.FFN_UP, T.FFN_GATE, T.FFN_DOWN, T.FFN_NORM, T.ATTN_Q, T.FFN_UP_EXP, T.FFN_GATE_INP):
        assert layer_name(7, gguf.TENSOR_NAMES[t].removeprefix("blk.{bid}.") + ".weight") == \
            gguf.TENSOR_NAMES[t].format(bid=7) + ".weight"
    assert layer_name(3) == "blk.3."


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
    from hotneurons.export.gguf_model import llama_metadata, vocab_from_tokenizer

    from bench import memory_models as mm

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
    (weights.qtensor.convert to kernel_format; an untied embedding is read as stored), each FFN's hot and cold rows
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
    lay_out_ffns(lm.layers, lm.adapter, rt.ffns, placement)


@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_file_equals_hf_on_gguf_py_weights(mix, mixed_files):
    """Read with no flag (a random half of each layer's neurons hot, dense mask): every tensor in its stored type, the
    converted ones named in one notice; logits equal to HF's model (transformers' GGUF loader: gguf-py's de-quantized
    weights) on the weights the layout holds, and within the conversions' rounding of HF's on the file's own."""
    from hotneurons.artifacts.placement import Placement
    from hotneurons.models.family import load_model
    from hotneurons.runtime.config import RuntimeConfig
    from hotneurons.runtime.generate import generate
    from hotneurons.runtime.load import load_source_runtime
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
    from hotneurons.runtime.cli import open_runtime, runtime_request
    from hotneurons.server.cli import main as serve_main
    from hotneurons.solver.cli import main as solve

    run = tmp_path / "run"
    path = mixed_files["q4_k_m"]
    for cmd, args in ((profile, ["--model", str(path), "--dataset", str(text_corpus), "--tokens", "512",
                                 "--seq-len", "64", "--samples-per-layer", "0", "--calibration-tokens", "256",
                                 "--out", str(run), "--device", "cpu", "--quiet"]),
                      (solve, ["--run", str(run), "--hardware", "rtx4090", "--vram", "1MB", "--reserve", "0",
                               "--ctx", "128"]),
                      (generate_main, ["--run", str(run), "--device", "cpu", "-n", "4", "--prompt", "The quick",
                                       "--json"])):
        res = CliRunner().invoke(cmd, args)
        assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4
    flags = serve_main.make_context("pi-serve", ["--run", str(run), "--device", "cpu", "--port", "0"]).params
    rt = open_runtime(runtime_request(flags))
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
    from hotneurons.runtime.generate import generate
    from hotneurons.runtime.load import load_source_runtime

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
