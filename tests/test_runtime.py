"""pi-generate on tiny random models: greedy tokens and logits equal HF `generate` on the same dense model.

The FFN weights are rounded to bfloat16 first (the cold rows are stored in bf16), so the hybrid runtime and HF
compute with identical weights; logits then agree within LOGIT_ATOL (float32 sums in another order).
"""

import copy
import zlib

import numpy as np
import pytest
import tiny
import torch
from hotneurons.common.models import load_model
from hotneurons.predictors.train import Predictor, Predictors
from hotneurons.runtime import cold_rows as C
from hotneurons.runtime import kernels as K
from hotneurons.runtime import ops
from hotneurons.runtime.generate import RuntimeConfig, build_runtime, generate
from hotneurons.runtime.placement import Placement
from hotneurons.runtime.sampling import Sampling, sample

LOGIT_ATOL = 1e-4
NEW = 12
PROMPT = "The quick brown fox"


# ---------------------------------------------------------------------------------------------------------------
# Kernels against a float64 numpy reference


def _bf16(a: np.ndarray) -> np.ndarray:
    return C.to_bf16_bits(torch.from_numpy(a))


def _widen64(rows: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """Stored rows (bf16 bits or int8) and their (n, groups) scales -> the float64 weights they stand for."""
    if rows.dtype == np.int8:
        per_weight = np.repeat(scale.astype(np.float64), group, axis=1)[:, :rows.shape[1]]  # (n, d)
        return rows.astype(np.float64) * per_weight
    return (rows.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def reference(act: str, x, idx, rows: C.ColdRows) -> np.ndarray:
    """float64 numpy: sum over j in idx of h_j(x) * down_t[j], from the weights the stored rows stand for."""
    from math import erf

    x = x.astype(np.float64)
    u = _widen64(rows.up, rows.scale[1], rows.group)[idx] @ x
    g = _widen64(rows.gate, rows.scale[0], rows.group)[idx] @ x if rows.gate is not None else None
    if g is None:
        u = u + rows.b_up[idx].astype(np.float64)
    gelu_tanh = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))  # noqa: E731
    erf64 = np.vectorize(erf, otypes=[np.float64])
    h = {"relu": lambda: np.maximum(u, 0), "gelu": lambda: 0.5 * u * (1 + erf64(u / np.sqrt(2))),
         "reglu": lambda: np.maximum(g, 0) * u, "drelu": lambda: np.maximum(g, 0) * np.maximum(u, 0),
         "swiglu": lambda: g / (1 + np.exp(-g)) * u, "geglu": lambda: gelu_tanh(g) * u}[act]()
    return h @ _widen64(rows.down_t, rows.scale[2], rows.group)[idx]


def random_rows(rng, act: str, d: int, n: int, dtype: str) -> C.ColdRows:
    w = lambda: torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d))  # noqa: E731
    gated = act in K.GATED
    b_up = None if gated else torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.1)
    return C.ColdRows.from_weights(w() if gated else None, w(), b_up, w(), dtype)


@pytest.mark.parametrize("dtype", C.COLD_DTYPES)
@pytest.mark.parametrize("act", list(K.ACT_CODE))
@pytest.mark.parametrize("d,n", [(37, 23), (64, 129), (192, 17), (200, 40)])  # int8 groups: 1 short, 1, 3, 3 + a short
@pytest.mark.parametrize("which", ["empty", "all", "random", "one", "active"])
def test_kernel_matches_float64_reference(act, d, n, which, dtype):
    rng = np.random.default_rng(zlib.crc32(repr((act, d, n, which, dtype)).encode()))  # the same draw every run
    x = rng.standard_normal(d).astype(np.float32)
    rows = random_rows(rng, act, d, n, dtype)
    assert rows.dtype == dtype
    # active: the neurons whose gate (ungated: pre-activation) is positive, as a predictor marks them, so that most
    # groups of four take the kernel's path that reads four neurons' rows at once
    pre = (_widen64(rows.gate, rows.scale[0], rows.group) @ x if act in K.GATED
           else _widen64(rows.up, rows.scale[1], rows.group) @ x + rows.b_up)
    idx = {"empty": np.zeros(0, np.int64), "all": np.arange(n, dtype=np.int64), "one": np.array([n - 1]),
           "random": np.flatnonzero(rng.random(n) < 0.4), "active": np.flatnonzero(pre > 0)}[which].astype(np.int64)
    out = np.full(d, np.nan, np.float32)  # must be overwritten
    part = np.full((3, d), np.nan, np.float32)  # scratch: its contents must not matter
    K.ffn_rows(act, x, idx, rows, out, part)
    ref = reference(act, x, idx, rows)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    # out of shape (0,): the sum left in the partial rows, for the GPU to add up; rows of threads with no neurons
    # (more rows than active neurons: "empty", "one") zeroed over stale values
    part = np.full((5, d), np.nan, np.float32)
    K.ffn_rows(act, x, idx, rows, np.empty(0, np.float32), part)
    np.testing.assert_allclose(part.sum(0), ref, rtol=1e-4, atol=1e-5)
    # the torch backend (hot neurons) against the same reference, on the same weights
    w = rows.float32()
    t = lambda name: None if w[name] is None else w[name][idx].double()  # noqa: E731
    y = ops.ffn_rows_torch(act, torch.from_numpy(x.astype(np.float64))[None], t("gate"), t("up"),
                         None if act in K.GATED else t("b_up"), t("down_t"))[0]
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-6, atol=1e-6)  # int8: q * scale rounded to float32
    # the device backend over rows read in place (on the CPU: views), with padding rows that must add nothing
    pad = 3
    ids = torch.from_numpy(np.concatenate([idx, np.zeros(pad, np.int64)]))
    valid = torch.arange(len(ids)) < len(idx)
    y = C.ffn_rows_mapped(act, torch.from_numpy(x)[None], ids, valid, C.map_rows(rows, torch.device("cpu")))[0]
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_gated_codes_are_the_gated_activations():
    """cold_ffn tells gated FFNs from ungated ones by their code alone."""
    assert {a for a, c in K.ACT_CODE.items() if c >= K.FIRST_GATED} == set(K.GATED)
    assert set(K.ACT_CODE) == set(K.GATED) | set(K.UNGATED)


@pytest.mark.parametrize("dtype", C.COLD_DTYPES)
def test_kernel_threads_do_not_change_the_result(dtype):
    rng = np.random.default_rng(1)
    d, n = 48, 200
    x = rng.standard_normal(d).astype(np.float32)
    rows = random_rows(rng, "swiglu", d, n, dtype)
    idx = np.arange(n, dtype=np.int64)
    outs = [K.ffn_rows("swiglu", x, idx, rows, np.empty(d, np.float32), np.empty((threads, d), np.float32))
            for threads in (1, 3, 7)]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_kernel_claims_cover_each_position_once(threads):
    """cold_ffn's claims (kernels._claim): claim numbers 0, 1, ... take [0, k) in order, each position once, CHUNK at
    a time and 4 at a time over the last TAIL * threads positions (nothing past k: the claims after the last are
    empty)."""
    for k in (0, 1, 3, 4, 5, 8, 9, 31, 32, 33, K.TAIL * threads, K.TAIL * threads + 5, 1433):
        head = max(0, k - K.TAIL * threads) // K.CHUNK * K.CHUNK
        spans, c = [], 0
        while True:
            q0, q1 = K._claim(c, k, head)
            if q0 >= k:
                break
            spans.append((q0, q1))
            c += 1
        assert [q for a, b in spans for q in range(a, b)] == list(range(k))
        assert all(b - a == (K.CHUNK if a < head else min(4, k - a)) for a, b in spans)
        assert k - head <= K.TAIL * threads + K.CHUNK


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 128, 1003, 25001])
def test_bit_indices_equal_flatnonzero(n):
    """The packed cold mask -> active positions (kernels.bit_indices, one count-trailing-zeros per set bit) as
    np.flatnonzero gives them from the bool mask, at densities from none to all, lengths that are not a multiple of
    64 (or of 8) included; the packing as numpy's (little bit order); nothing written past out[:n]."""
    rng = np.random.default_rng(n)
    for p in (0.0, 0.01, 0.06, 0.5, 0.97, 1.0):
        m = rng.random(n) < p
        bits = K.pack_mask(m)
        assert bits.shape == (K.mask_bytes(n),) and K.mask_bytes(n) % 8 == 0 and 8 * K.mask_bytes(n) >= n
        np.testing.assert_array_equal(np.unpackbits(bits, bitorder="little")[:n], m)
        assert not np.unpackbits(bits, bitorder="little")[n:].any()  # the padding is zero
        out = np.full(n + 1, -7, np.int64)
        k = K.bit_indices(bits.view(np.uint64), n, out[:n])
        np.testing.assert_array_equal(out[:k], np.flatnonzero(m))
        assert out[n] == -7


def test_bit_indices_leaves_out_bits_past_n():
    """Set bits at n and past (the padding, which the GPU never writes) are not positions: every bit set."""
    words = np.full(3, np.iinfo(np.uint64).max, np.uint64)  # 192 bits
    for n in (0, 1, 63, 64, 65, 130, 192):
        out = np.full(200, -7, np.int64)
        k = K.bit_indices(words, n, out)
        np.testing.assert_array_equal(out[:k], np.arange(n))
        assert (out[k:] == -7).all()


@pytest.mark.parametrize("n_cold", [0, 1, 7, 8, 63, 64, 65, 203, 1000])
def test_predict_packs_the_host_mask_as_bits(n_cold):
    """ops.predict (the torch ops' predictor, fused.predict's twin): the host mask's first ceil(n_cold / 8) bytes
    are np.packbits of the first n_cold decisions (little bit order), stale bits overwritten, the bits of the hot rows
    after them zero (here every hot row fires), the buffer's bytes after them left alone; bit_indices reads them back
    as the decisions' positions; the device mask is the decisions; firings += the decisions."""
    g = torch.Generator().manual_seed(n_cold)
    d, hidden, rows = 40, 24, n_cold + 37
    x, fc1 = torch.randn(d, generator=g), torch.randn(hidden, d, generator=g)
    fc2 = torch.randn(rows, hidden, generator=g)
    fc2[n_cold:] = 0  # hot rows: logit 0, on the threshold: they fire
    fired0 = torch.randint(0, 5, (rows,), generator=g, dtype=torch.int32)
    fired, m_dev = fired0.clone(), torch.zeros(n_cold, dtype=torch.bool)
    m_host = torch.full((K.mask_bytes(n_cold),), 0xA5, dtype=torch.uint8)  # stale bits, then the padding
    ops.predict(x, fc1, fc2, torch.zeros(1), fired, m_dev, m_host, n_cold)
    fire = (fired - fired0).numpy()  # (rows,) the decisions
    assert set(np.unique(fire)) <= {0, 1} and fire[n_cold:].all()
    assert n_cold < 8 or 0 < fire[:n_cold].sum() < n_cold  # some cold rows fire, some do not
    nb = -(-n_cold // 8)
    np.testing.assert_array_equal(m_host[:nb].numpy(), np.packbits(fire[:n_cold].astype(bool), bitorder="little"))
    assert bool((m_host[nb:] == 0xA5).all())
    np.testing.assert_array_equal(m_dev.numpy(), fire[:n_cold].astype(bool))
    bits = m_host.numpy().copy()
    bits[nb:] = 0  # the runtime's buffer starts zeroed and only the first nb bytes are written
    out = np.empty(n_cold, np.int64)
    np.testing.assert_array_equal(out[:K.bit_indices(bits.view(np.uint64), n_cold, out)], np.flatnonzero(fire[:n_cold]))


def _cold_layer(rows: C.ColdRows, act: str, m: np.ndarray, x: np.ndarray, skip: int, marks: np.ndarray,
                ready: np.ndarray = K.NO_FLAGS, release: np.ndarray = K.NO_FLAGS, i: int = -1,
                bits: np.ndarray | None = None) -> tuple[int, np.ndarray]:
    """kernels.cold_layer on the bool mask m packed (or on `bits`, its packed buffer, written elsewhere), over fresh
    scratch (NaN-filled: its contents must not matter) -> (k, out)."""
    n, d = m.shape[0], x.shape[0]
    out, part = np.full(d, np.nan, np.float32), np.full((3, d), np.nan, np.float32)
    words = (K.pack_mask(m) if bits is None else bits).view(np.uint64)
    k = K.cold_layer(ready, release, i, words, np.full(n, -1, np.int64), skip, x, rows.gate_arg, rows.up, rows.b_up,
                     rows.down_t, rows.scale, rows.group, part, out, K.ACT_CODE[act], marks)
    return k, out


@pytest.mark.parametrize("dtype", C.COLD_DTYPES)
@pytest.mark.parametrize("act", ["reglu", "swiglu", "relu", "gelu"])
def test_cold_layer_equals_float64_reference(act, dtype):
    """One decode layer's CPU part in one Numba call (the packed mask -> positions, the device's first `skip` left
    out, the kernel) against the float64 reference over np.flatnonzero(mask)[skip:]; the tally."""
    rng = np.random.default_rng(zlib.crc32(repr((act, dtype)).encode()))
    d, n = 72, 203  # a mask length that is not a multiple of 8 (nor of 64)
    rows = random_rows(rng, act, d, n, dtype)
    x = rng.standard_normal(d).astype(np.float32)
    marks = np.zeros(2)
    calls = 0
    for p in (0.0, 0.1, 0.6):
        m = rng.random(n) < p
        for skip in (0, 5, n + 1):  # none, some, more than are marked
            k, out = _cold_layer(rows, act, m, x, skip, marks)
            calls += 1
            assert k == m.sum()
            np.testing.assert_allclose(out, reference(act, x, np.flatnonzero(m)[skip:], rows), rtol=1e-4, atol=1e-5)
    assert marks[0] == calls


def test_cold_layer_waits_for_the_ready_signal_then_releases():
    """With a layer index, cold_layer spins until ready[i] is set (here by another thread, which writes x and the
    mask first, as the GPU does), resets it, computes from what was written before the signal and sets release[i]."""
    import threading
    import time

    rng = np.random.default_rng(5)
    d, n = 64, 96
    rows = random_rows(rng, "reglu", d, n, "bf16")
    x, bits = np.zeros(d, np.float32), np.zeros(K.mask_bytes(n), np.uint8)  # the host buffers before the GPU writes
    x_new, m_new = rng.standard_normal(d).astype(np.float32), rng.random(n) < 0.3
    ready, release = np.zeros(3, np.int32), np.zeros(3, np.int32)

    def gpu() -> None:
        time.sleep(0.2)
        x[:], bits[:] = x_new, K.pack_mask(m_new)
        ready[1] = 1

    t = threading.Thread(target=gpu)
    t.start()
    k, out = _cold_layer(rows, "reglu", np.zeros(n, bool), x, 0, np.zeros(2), ready, release, 1,
                         bits=bits)  # nogil: the thread runs
    t.join()
    assert k == m_new.sum() and ready.tolist() == [0, 0, 0] and release.tolist() == [0, 1, 0]
    np.testing.assert_allclose(out, reference("reglu", x_new, np.flatnonzero(m_new), rows), rtol=1e-4, atol=1e-5)
    assert not K.wait_ready(ready, 1, 1000)  # no signal: gives up instead of hanging
    ready[2] = 1
    assert K.wait_ready(ready, 2, 1000) and ready[2] == 0


def test_row_gather_sums_every_row_once():
    """The DRAM ceiling's read (dram.row_gather_bw) covers every row it times, whatever the thread count."""
    from hotneurons.runtime import dram

    rng = np.random.default_rng(2)
    rows = rng.standard_normal((40, 96)).astype(np.float32)  # 40 rows: five groups of 8
    order = rng.permutation(40).astype(np.int64)
    for threads in (1, 3, 16):
        np.testing.assert_allclose(dram._sum_gathered(rows, order, threads), rows.astype(np.float64).sum(),
                                   rtol=0, atol=1e-6 * np.abs(rows).sum())  # float32 sums in another order
    assert dram.row_gather_bw(rng.standard_normal(2**17).astype(np.float32), 2) > 0


def test_bf16_round_trip():
    w = torch.randn(5, 7)
    assert torch.equal(C.from_bf16_bits(C.to_bf16_bits(w)), w.bfloat16().float())


def test_int8_groups_round_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9000, 33, generator=g) * torch.logspace(-3, 1, 9000)[:, None]  # rows of very different sizes
    w[5, 8:16] = 0  # an all-zero group stays zero
    q, scale = C.to_int8_groups(w, group=8)  # groups 0-7, ..., 24-31 and a short one, 32
    assert q.dtype == np.int8 and q.shape == (9000, 33) and scale.shape == (9000, 5)
    per_weight = torch.from_numpy(np.repeat(scale, 8, axis=1)[:, :33]).double()
    err = (torch.from_numpy(q).double() * per_weight - w.double()).abs()
    assert bool((err <= per_weight * (0.5 + 1e-5)).all())
    assert torch.equal(C.from_int8_groups(q, scale, 8), torch.from_numpy(q).float() * per_weight.float())
    peak = np.abs(q.astype(np.int32))
    peak = np.stack([peak[:, i:i + 8].max(axis=1) for i in range(0, 33, 8)], axis=1)  # (n, groups)
    assert peak[5, 1] == 0 and (np.delete(peak.ravel(), 5 * 5 + 1) == 127).all()  # nonzero groups use the full range


def test_cold_rows_bytes_and_bad_dtype():
    rng = np.random.default_rng(0)
    bf16, int8 = (random_rows(rng, "reglu", 130, 100, t) for t in ("bf16", "int8"))
    assert bf16.up.nbytes == 2 * int8.up.nbytes and int8.group == K.INT8_GROUP == 64
    assert int8.nbytes() == 3 * 100 * 130 + 4 * 100 + 3 * 100 * 3 * 4  # rows, b_up, 3 scales per row (64 + 64 + 2)
    with pytest.raises(ValueError, match="unknown cold-row dtype 'fp8'.*bf16, int8"):
        random_rows(rng, "reglu", 8, 4, "fp8")


# ---------------------------------------------------------------------------------------------------------------
# Whole-model equality with HF generate


def hf_greedy(lm, prompt_ids, n=NEW):
    out = lm.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), [lg[0] for lg in out.logits]


def make_placement(lm, kind: str, seed: int = 0) -> Placement:
    n_layers, n = len(lm.layers), lm.info["n_neurons"]
    if kind in ("gpu", "cpu"):
        return Placement.uniform(n_layers, n, kind == "gpu")
    rng = np.random.default_rng(seed)
    return Placement(tuple(rng.random(n) < 0.5 for _ in range(n_layers)))


def check_equal(lm, cfg, placement=None, predictors=None, taus=None, atol=LOGIT_ATOL):
    ref = copy.deepcopy(lm)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    want_ids, want_logits = hf_greedy(ref, ids)
    rt = build_runtime(lm, cfg, placement, predictors, taus)
    g = generate(rt, ids, NEW, keep_logits=True)
    assert g.token_ids == want_ids
    diff = max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits))
    assert diff < atol, diff
    return g


RELU = ["opt", "llama-reglu", "mistral-drelu", "falcon-relu"]


@pytest.mark.parametrize("family", RELU)
@pytest.mark.parametrize("where", ["gpu", "cpu", "mixed"])
def test_oracle_equals_hf(family, where, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    g = check_equal(lm, RuntimeConfig(oracle=True, device="cpu"), make_placement(lm, where))
    s = g.stats
    assert s["mode"] == "oracle" and 0 < s["ffn_sparsity"] < 1
    assert s["gpu_activation_share"] == pytest.approx({"gpu": 1.0, "cpu": 0.0}.get(where, s["gpu_activation_share"]))
    p = lm.info["params"]
    untied_embedding = 4 * p["embedding"] if p["lm_head"] else 0  # float32 bytes, kept in CPU RAM
    assert (s["bytes_cpu"] == untied_embedding) == (where == "gpu")


@pytest.mark.parametrize("family", ["llama-swiglu", "qwen2-swiglu", "gemma-geglu", "falcon-gelu"])
def test_dense_equals_hf(family, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    g = check_equal(lm, RuntimeConfig(mode="dense", device="cpu"), make_placement(lm, "mixed"))
    assert g.stats["ffn_sparsity"] == 0.0


@pytest.mark.parametrize("family", ["opt", "llama-swiglu"])
def test_layer_split_equals_hf(family, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    g = check_equal(lm, RuntimeConfig(mode="layer-split", device="cpu", gpu_layers=1))
    assert g.stats["gpu_activation_share"] == 0.5 and g.stats["bytes_cpu"] > 0


@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_untied_input_embedding_stays_in_cpu_ram(family, tiny_model_dir):
    """An untied embedding is looked up on the CPU (the static decoder: into a host row layer 0 copies in), and
    neither the runtime nor layer-split counts it on the device; a tied one (OPT's) is the LM head and stays."""
    from hotneurons.runtime.generate import layer_split_count
    from hotneurons.runtime.offload import OnCPUEmbedding

    lm = tiny.load_rounded(tiny_model_dir(family), family)
    p, size = lm.info["params"], 4  # float32
    untied = p["lm_head"] > 0
    assert untied == (family == "llama-reglu")
    per_layer = sum(t.numel() for t in lm.layers[0].parameters()) * size
    fixed = (p["total"] - p["embedding"] * untied) * size - len(lm.layers) * per_layer  # head, norms (tied: emb)
    assert layer_split_count(lm, fixed + per_layer, None, torch.float32) == 1
    assert layer_split_count(lm, fixed + per_layer - 1, None, torch.float32) == 0
    with pytest.raises(ValueError, match="raise --vram"):
        layer_split_count(lm, fixed - 1, None, torch.float32)
    g = check_equal(lm, RuntimeConfig(oracle=True, device="cpu"), make_placement(lm, "gpu"))
    emb = lm.model.get_input_embeddings()
    assert isinstance(emb, OnCPUEmbedding) == untied
    assert g.stats["bytes_cpu"] == p["embedding"] * size * untied
    if untied:
        assert emb.weight.device.type == "cpu" and emb.num_embeddings == lm.info["vocab_size"]
        on_device = [*lm.model.parameters(), *lm.model.buffers()]  # what model.to(device) moves
        assert all(t.data_ptr() != emb.weight.data_ptr() for t in on_device)


@pytest.mark.parametrize("family,cfg,where", [
    ("llama-reglu", RuntimeConfig(oracle=True, device="cpu", cold_dtype="int8"), "cpu"),
    ("opt", RuntimeConfig(oracle=True, device="cpu", cold_dtype="int8"), "mixed"),
    ("falcon-gelu", RuntimeConfig(mode="dense", device="cpu", cold_dtype="int8"), "cpu"),
    ("llama-swiglu", RuntimeConfig(mode="layer-split", device="cpu", gpu_layers=1, cold_dtype="int8"), None)])
def test_int8_cold_rows_equal_hf_on_the_weights_they_stand_for(family, cfg, where, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    tiny.round_ffns_to_int8(lm)
    g = check_equal(lm, cfg, None if where is None else make_placement(lm, where))
    assert g.stats["cold_dtype"] == "int8"


def test_int8_cold_rows_halve_the_cpu_bytes(tiny_model_dir):
    family = "llama-reglu"
    rts = {t: build_runtime(tiny.load_rounded(tiny_model_dir(family), family),
                            RuntimeConfig(mode="dense", device="cpu", cold_dtype=t),
                            make_placement(tiny.load_rounded(tiny_model_dir(family), family), "cpu"))
           for t in ("bf16", "int8")}
    b = {t: sum(f.cold_bytes() for f in rt.ffns) for t, rt in rts.items()}  # bytes_cpu less the untied embedding
    assert b["int8"] < 0.55 * b["bf16"]
    emb = 4 * rts["bf16"].lm.info["params"]["embedding"]  # float32, in CPU RAM
    assert all(rt.bytes_cpu == b[t] + emb for t, rt in rts.items())
    with pytest.raises(ValueError, match="unknown cold-row dtype 'int4'"):
        build_runtime(tiny.load_rounded(tiny_model_dir(family), family), RuntimeConfig(device="cpu", cold_dtype="int4"))


def always_on_predictors(lm, threshold: float) -> Predictors:
    d, n = lm.info["d_model"], lm.info["n_neurons"]
    torch.manual_seed(0)
    layers = {i: Predictor(d, 8, n, threshold).eval() for i in range(len(lm.layers))}
    return Predictors(layers, {"layers": []}, {})


def exact_predictors(lm) -> Predictors:
    """Predictors whose logits are each neuron's gate pre-activation: fc1 = [I; -I], fc2 = [G, -G], so that
    G relu(x) - G relu(-x) = G x; threshold 0. They mark exactly the neurons the ReLU gate opens, so computing only
    those is exact, and a mask given to the wrong neurons is not."""
    d, n = lm.info["d_model"], lm.info["n_neurons"]
    layers = {}
    for i, layer in enumerate(lm.layers):
        g = lm.adapter.layer_ffn(layer)["gate"].weight.detach().float()  # (n, d)
        p = Predictor(d, 2 * d, n, 0.0).eval()
        with torch.no_grad():
            p.fc1.weight.copy_(torch.cat((torch.eye(d), -torch.eye(d))))
            p.fc2.weight.copy_(torch.cat((g, -g), 1))
        layers[i] = p
    return Predictors(layers, {"layers": []}, {})


def test_exact_predictor_equals_hf(tiny_model_dir):
    """The predictor's masks reach the neurons they are for (fc2's rows are reordered cold first in HybridFFN): with a
    predictor that marks exactly the open gates, hybrid is HF's dense model while it skips half the neurons."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    g = check_equal(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), exact_predictors(lm))
    assert g.stats["mode"] == "hybrid" and 0.3 < g.stats["ffn_sparsity"] < 0.7
    assert 0 < g.stats["gpu_activation_share"] < 1


def test_predictor_that_fires_everywhere_equals_hf(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    g = check_equal(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), always_on_predictors(lm, -1e30))
    assert g.stats["mode"] == "hybrid" and g.stats["ffn_sparsity"] == 0.0


def test_ffn_probe_sees_each_decode_call_in_order(tiny_model_dir):
    """HybridFFN.probe (bench timelines): called at each decode call's marks in order, layer by layer; generate
    decodes through HF's layers while one is set (the static decoder calls no marks), with the same tokens."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    rt = build_runtime(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), always_on_predictors(lm, -1e30))
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    plain = generate(rt, ids, NEW)
    seen = []
    for f in rt.ffns:
        f.probe = lambda f, mark: seen.append((f.layer, mark))
    assert generate(rt, ids, NEW).token_ids == plain.token_ids
    marks = ("start", "cpu_start", "cpu_end", "end")  # on the CPU: no marks around a GPU hot part
    assert seen == [(f.layer, m) for _ in range(NEW - 1) for f in rt.ffns for m in marks]


def test_build_runtime_leaves_the_callers_predictors_alone(tiny_model_dir):
    """Module.to moves in place: a runtime must take copies, or building a second one (another dtype or device)
    would move the weights that the first one's CUDA graphs read."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    preds = always_on_predictors(lm, -1e30)
    before = {i: p.fc1.weight for i, p in preds.layers.items()}
    rt = build_runtime(copy.deepcopy(lm), RuntimeConfig(device="cpu", dtype="bfloat16"), make_placement(lm, "mixed"),
                       preds)
    assert all(preds.layers[i].fc1.weight is w and w.dtype == torch.float32 for i, w in before.items())
    assert all(f.pred_fc1.dtype == f.pred_fc2.dtype == torch.bfloat16 for f in rt.ffns)


def test_predictor_that_never_fires_keeps_only_hot_neurons(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("opt"), "opt")
    rt = build_runtime(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), always_on_predictors(lm, 1e30))
    g = generate(rt, list(lm.tokenizer(PROMPT)["input_ids"]), 4)
    assert g.stats["ffn_sparsity"] == 1.0 and len(g.token_ids) == 4
    # 3 decode steps, the first left out of the median step; one token decodes no step, so it has none
    assert g.stats["decode_step_ms_median"] > 0
    assert generate(rt, list(lm.tokenizer(PROMPT)["input_ids"]), 1).stats["decode_step_ms_median"] is None


# ---------------------------------------------------------------------------------------------------------------
# Sampling


def test_sampling_rules():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert sample(logits, [], Sampling(), gen) == 1
    tied = torch.tensor([0.5, 2.0, 2.0, -1.0], dtype=torch.float16)  # greedy takes the first of equal maxima
    assert sample(tied, [], Sampling(), gen) == 1
    assert sample(logits, [1], Sampling(repetition_penalty=2.0), gen) == 2  # 3/2 < 2
    assert sample(logits, [], Sampling(temperature=5.0, top_k=1), gen) == 1
    assert sample(logits, [], Sampling(temperature=5.0, top_p=1e-6), gen) == 1
    draws = [sample(logits, [], Sampling(temperature=1.0, top_k=2), torch.Generator().manual_seed(s))
             for s in range(40)]
    assert set(draws) == {1, 2}
    again = [sample(logits, [], Sampling(temperature=1.0, top_k=2), torch.Generator().manual_seed(s))
             for s in range(40)]
    assert draws == again  # seeded


def test_gated_ffn_with_biases_is_refused(tmp_path):
    """The kernels have no gate/up bias for gated FFNs: such a model must be refused, not run wrongly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, hidden_act="relu", mlp_bias=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tiny.byte_tokenizer().save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="gate/up biases"):
        build_runtime(lm, RuntimeConfig(mode="dense", device="cpu"))


@pytest.mark.parametrize("family,where", [("llama-reglu", "mixed"), ("mistral-drelu", "cpu"), ("qwen2-swiglu", "gpu"),
                                         ("qwen3-swiglu", "gpu")])
def test_static_decoder_equals_hf_decode(family, where, tiny_model_dir):
    """runtime/static_decoder.py (static KV cache; CUDA graphs on CUDA) against the same runtime decoding through HF
    layers."""
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    placement = make_placement(lm, where)
    preds = always_on_predictors(lm, -1e30)
    mode = {"mode": "dense"} if family.endswith("swiglu") else {}
    rt_hf = build_runtime(copy.deepcopy(lm), RuntimeConfig(device="cpu", static_decode=False, **mode), placement,
                          None if mode else preds)
    rt = build_runtime(lm, RuntimeConfig(device="cpu", **mode), placement, None if mode else preds)
    assert rt.fast is not None and rt_hf.fast is None
    a = generate(rt, ids, NEW, keep_logits=True)
    b = generate(rt_hf, ids, NEW, keep_logits=True)
    assert a.token_ids == b.token_ids
    assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < LOGIT_ATOL
    assert a.stats["ffn_sparsity"] == b.stats["ffn_sparsity"]
    # past the static cache the same call decodes through HF
    rt.fast.capacity = len(ids) + 3
    c = generate(rt, ids, NEW, keep_logits=True)
    assert c.token_ids == b.token_ids


@pytest.mark.parametrize("family,mode,int8", [("llama-reglu", "hybrid", False), ("qwen2-swiglu", "dense", False),
                                             ("llama-reglu", "hybrid", True)])
def test_cold_rows_shared_with_the_device_equal_hf(family, mode, int8, tiny_model_dir, monkeypatch):
    """--pcie-share: after the calibration tokens the device computes the first marked cold neurons of each token
    from the rows in place (here on the CPU, as views) and the CPU the rest; the logits stay HF's."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "CALIBRATION_TOKENS", 4)
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    if int8:
        tiny.round_ffns_to_int8(lm)
    cfg = RuntimeConfig(device="cpu", mode=mode, pcie_share=0.5, cold_dtype="int8" if int8 else "bf16")
    preds = always_on_predictors(lm, -1e30) if mode == "hybrid" else None
    g = check_equal(lm, cfg, make_placement(lm, "cpu" if mode == "dense" else "mixed"), preds)
    rt_ffns = [m for m in lm.model.modules() if hasattr(m, "mapped_rows")]
    n_cold = [f.n_cold for f in rt_ffns]
    assert [f.mapped_rows for f in rt_ffns] == [round(0.5 * n) for n in n_cold]  # every cold neuron marked here
    assert g.stats["pcie_share"] == 0.5 and g.stats["pcie_rows_per_layer"] > 0
    assert g.stats["pcie_balance"] == []  # a given share is not moved
    assert all(r > 0 for r in B.measure_pcie_rates(rt_ffns[0], rows=16, reps=2))


class SimulatedMachine:
    """tune_mapped_rows on a simulated machine: a layer's GPU part takes hot_ms + K / device_rate, its CPU part
    (marked - K) / cpu_rate times a factor that varies by `spread` from layer to layer and token to token, and the
    next layer's wait grows by whatever the GPU part ran past the CPU's (5 us of clock noise; the GPU's rate measured
    at start off by `believed`). `cpu_rate` may be changed between steps (another load on the machine)."""

    layers, marked, pre_ms = 12, 1880, 0.285

    def __init__(self, hot_ms, device_rate, cpu_rate, start, believed, spread):
        from types import SimpleNamespace

        import hotneurons.runtime.balance as B

        self.B, self.hot_ms, self.device_rate, self.cpu_rate, self.spread = B, hot_ms, device_rate, cpu_rate, spread
        self.rng = np.random.default_rng(0)
        self.ffns = [SimpleNamespace(cold_marks=np.zeros(2), mapped=object(), mapped_rows=0, reset_graphs=lambda: None)
                     for _ in range(self.layers)]
        self.fast = SimpleNamespace(timing=[], layers=self.ffns, reset_graphs=lambda: None)
        self.rt = SimpleNamespace(cfg=RuntimeConfig(), pcie_tuned=False, pcie_share=start, ffns=self.ffns,
                                  fast=self.fast, pcie_balance=B.ShareBalance(believed * device_rate))

    def factor(self, size: int) -> np.ndarray:  # the CPU part's spread
        return np.exp(self.rng.normal(0, self.spread, size))

    def layer_ms(self, k: float, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # (GPU past the CPU, CPU part)
        cpu = (self.marked - k) / self.cpu_rate * f
        return np.maximum(0.0, self.hot_ms + k / self.device_rate - cpu), cpu

    def run(self, steps: int) -> None:
        for _ in range(steps):
            over, cpu = self.layer_ms(self.ffns[0].mapped_rows, self.factor(self.layers))
            if self.fast.timing is not None:
                noise = self.rng.normal(0, 0.005, self.layers + 1)
                self.fast.timing.append({"wait_pre_ms": list(self.pre_ms + np.r_[0.0, over[:-1]] + noise[:-1]),
                                         "cold_ms": list(cpu), "final_ms": 0.3 + over[-1] + noise[-1]})
            for f in self.ffns:
                f.cold_marks += (1, self.marked)
            self.B.tune_mapped_rows(self.rt)

    def step_ms(self, k: float) -> float:  # a layer's mean time at K rows on the GPU
        sample = self.factor(20000)
        return self.pre_ms + float(np.mean(sum(self.layer_ms(k, sample))))

    def share_is_near_best(self, tol: float = 1.02) -> bool:
        best = min(self.step_ms(k) for k in range(0, self.marked + 1, 4))
        return self.step_ms(self.ffns[0].mapped_rows) <= tol * best


@pytest.mark.parametrize("hot_ms,device_rate,cpu_rate,start,believed,spread", [
    (0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1), (0.14, 1000.0, 1300.0, 0.43, 1.3, 0.1),
    (0.14, 1000.0, 1300.0, 0.43, 0.7, 0.1), (0.14, 1000.0, 1300.0, 0.39, 1.0, 0.0),
    (0.0, 1000.0, 1300.0, 0.1, 1.0, 0.1), (0.3, 600.0, 1500.0, 0.5, 1.0, 0.2),
    (0.05, 2000.0, 800.0, 0.2, 1.0, 0.1)])
def test_share_balancing_finds_the_fastest_split(hot_ms, device_rate, cpu_rate, start, believed, spread):
    """After TUNING_TOKENS steps on a SimulatedMachine the series of rounds is over and the share's mean step is
    within 2% of the best K found by trying every K on the same distribution."""
    m = SimulatedMachine(hot_ms, device_rate, cpu_rate, start, believed, spread)
    m.run(m.B.TUNING_TOKENS)
    rt = m.rt
    assert rt.pcie_tuned and m.fast.timing is None and len(rt.pcie_balance.rounds) == m.B.BALANCE_ROUNDS
    assert m.share_is_near_best(), (rt.pcie_share, rt.pcie_balance.rounds)


@pytest.mark.parametrize("cpu_after", [1300.0, 650.0, 2600.0])
def test_share_is_rechecked_and_moved_when_the_machine_changes(cpu_after, monkeypatch):
    """RECHECK_TOKENS steps after the rounds, one timed round at the share kept: on an unchanged machine it keeps the
    share (no new graphs) and turns the host clock off; where the CPU's rate has since halved or doubled, it starts a
    new series, which ends within 3% of the new best split."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "RECHECK_TOKENS", 64)
    m = SimulatedMachine(0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1)
    m.run(B.TUNING_TOKENS)
    kept = m.ffns[0].mapped_rows
    m.cpu_rate = cpu_after
    m.run(B.RECHECK_TOKENS + B.BALANCE_TOKENS)
    rounds = m.rt.pcie_balance.rounds
    assert len(rounds) == B.BALANCE_ROUNDS + 1 and rounds[-1]["recheck"]
    if cpu_after == 1300.0:
        assert rounds[-1]["gain"] < B.RECHECK_GAIN and m.ffns[0].mapped_rows == kept
        assert m.rt.pcie_tuned and m.fast.timing is None
        return
    assert rounds[-1]["gain"] >= B.RECHECK_GAIN and not m.rt.pcie_tuned
    m.run((B.BALANCE_ROUNDS - 1) * (B.BALANCE_TOKENS + 1))
    assert m.rt.pcie_tuned and m.fast.timing is None and len(m.rt.pcie_balance.rounds) == 2 * B.BALANCE_ROUNDS
    assert m.share_is_near_best(1.03), (m.rt.pcie_share, m.rt.pcie_balance.rounds)


def test_recheck_leaves_another_timeline_alone(monkeypatch):
    """A re-check due while another timeline has the host clock on (bench diagnostics) waits until it is off, and one
    whose clock was taken over starts again: neither list is cut short or read as its own."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "RECHECK_TOKENS", 16)
    m = SimulatedMachine(0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1)
    m.run(B.TUNING_TOKENS)
    theirs = m.fast.timing = []
    m.run(B.RECHECK_TOKENS + 2 * B.BALANCE_TOKENS)
    assert m.fast.timing is theirs and len(theirs) == B.RECHECK_TOKENS + 2 * B.BALANCE_TOKENS
    m.fast.timing = None
    m.run(1)  # the re-check takes the clock
    assert m.fast.timing is m.rt.pcie_balance.clock
    theirs = m.fast.timing = []  # and another timeline takes it over
    m.run(B.BALANCE_TOKENS + 1)
    assert m.fast.timing is theirs and not any(r.get("recheck") for r in m.rt.pcie_balance.rounds)
    m.fast.timing = None
    m.run(B.BALANCE_TOKENS + 2)
    assert m.rt.pcie_balance.rounds[-1]["recheck"]


def test_share_recheck_off_keeps_the_first_series_share(monkeypatch):
    """RuntimeConfig.pcie_recheck=False (a bench A/B): after the first series of rounds the share stays and the host
    clock stays off, although the CPU's rate has since halved."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "RECHECK_TOKENS", 16)
    m = SimulatedMachine(0.14, 1000.0, 1300.0, 0.43, 1.0, 0.1)
    m.rt.cfg = RuntimeConfig(pcie_recheck=False)
    m.run(B.TUNING_TOKENS)
    kept, rounds = m.ffns[0].mapped_rows, len(m.rt.pcie_balance.rounds)
    m.cpu_rate = 650.0
    m.run(B.RECHECK_TOKENS + 2 * B.BALANCE_TOKENS)
    assert m.ffns[0].mapped_rows == kept and len(m.rt.pcie_balance.rounds) == rounds and m.fast.timing is None


def test_next_share_from_overruns_lands_on_the_balance():
    """Without spread in the CPU's times and where the model holds, one round whose GPU part ran past the CPU's moves
    K to where the two end together (to the grid's step)."""
    import hotneurons.runtime.balance as B

    marked, g, c, a, share = 2000.0, 900.0, 1200.0, 0.1, 0.6
    k = share * marked
    cpu, gpu = np.full((4, 12), (marked - k) / c), a + k / g
    new = B.next_share(share, marked, g, gpu - cpu, cpu)[0] * marked
    assert abs((a + new / g) - (marked - new) / c) < 2 * (marked / 256) * (1 / g + 1 / c)


def test_next_share_is_not_moved_by_one_stalled_cpu_part():
    """One CPU part stalled for 20 ms among a round's 48 samples (a page fault, the OS) does not send the share to its
    cap: the stall does not shrink with the rows the CPU keeps (bench/NOTES.md, machine BD)."""
    import hotneurons.runtime.balance as B

    rng = np.random.default_rng(0)
    over, cold = np.abs(rng.normal(0.5, 0.2, (4, 12))), np.abs(rng.normal(0.15, 0.03, (4, 12)))
    calm = B.next_share(0.855, 1142.0, 1000.0, over, cold, 0.418)[0]
    cold[1, 3] = 20.0
    assert calm < 0.855 and B.next_share(0.855, 1142.0, 1000.0, over, cold, 0.418)[0] == pytest.approx(calm, abs=0.02)


def test_pcie_share_out_of_range_is_refused(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    with pytest.raises(ValueError, match="--pcie-share 1.5 is out of range"):
        build_runtime(lm, RuntimeConfig(device="cpu", mode="dense", pcie_share=1.5))


def test_static_decoder_not_for_other_families(tiny_model_dir):
    from hotneurons.runtime.static_decoder import supported

    for family in ("opt", "falcon-relu", "gemma-geglu"):
        lm = tiny.load_rounded(tiny_model_dir(family), family)
        rt = build_runtime(lm, RuntimeConfig(mode="dense", device="cpu"))
        assert rt.fast is None and supported(lm, rt.ffns) is not None


def test_static_decoder_reads_q_k_v_as_one_weight_without_a_second_copy(tiny_model_dir):
    """The fused q/k/v weight is the Linear modules' memory (their weights are row slices of it), so the bytes the
    runtime counted are the bytes held: the parameters once, plus the static KV cache it allocated."""
    from hotneurons.runtime.offload import count_bytes

    lm = tiny.load_rounded(tiny_model_dir("qwen2-swiglu"), "qwen2-swiglu")  # q/k/v biases
    rt = build_runtime(lm, RuntimeConfig(mode="dense", device="cpu"))
    for layer, (w, b) in zip(lm.layers, rt.fast.qkv):
        a = layer.self_attn
        rows = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        assert w.shape[0] == sum(rows) and b.shape == (sum(rows),)
        starts = [0, rows[0], rows[0] + rows[1]]
        for m, s in zip((a.q_proj, a.k_proj, a.v_proj), starts):
            assert m.weight.data_ptr() == w[s].data_ptr() and m.bias.data_ptr() == b[s:].data_ptr()
    cache = sum(t.numel() * t.element_size() for t in (*rt.fast.k, *rt.fast.v))  # the static KV cache, counted too
    assert count_bytes(lm, rt.ffns, []) == (rt.bytes_gpu - cache, rt.bytes_cpu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_static_decoder_norm_and_softmax_round_as_hf(dtype):
    check_norm_and_softmax(dtype, "cpu", exact_norm=True)


@torch.inference_mode()  # as the decoder runs
def check_norm_and_softmax(dtype: torch.dtype, device: str, exact_norm: bool) -> None:
    """The two-kernel RMSNorm (torch's fused rms_norm in the input dtype, then the weight) and the softmax in the
    scores' dtype against HF's forms (float32 inside, then a cast), on fresh random inputs."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(int(zlib.crc32(str(dtype).encode())))
    norm = LlamaRMSNorm(512, eps=1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(512, generator=g)
    norm = norm.to(device, dtype)
    same = torch.equal if exact_norm else lambda a, b: torch.testing.assert_close(a, b) is None  # noqa: E731
    for scale in (0.01, 1.0, 30.0):
        h = (scale * torch.randn(1, 1, 512, generator=g)).to(device, dtype)
        assert same(ops.rms_norm(norm, h), norm(h))
        out = torch.empty(1, 1, 512, dtype=dtype, device=device)
        assert ops.rms_norm(norm, h, out=out) is out and same(out, norm(h))
    q = torch.randn(1, 2, 3, 16, generator=g).to(device, dtype)  # (1, kv heads, G, hd)
    keys, values = (torch.randn(1, 2, 10, 16, generator=g).to(device, dtype) for _ in range(2))
    filled = 7
    mask = torch.where(torch.arange(10) < filled, 0.0, float("-inf")).to(device, dtype).view(1, 1, 1, 10)
    s = torch.matmul(q, keys.transpose(-1, -2)).float()[..., :filled]  # HF: float32 softmax of the filled slots
    ref = torch.matmul(torch.softmax(s, -1).to(dtype), values[:, :, :filled])
    torch.testing.assert_close(ops.attend(q, keys, values, mask), ref)
    torch.testing.assert_close(ops.attend(q, keys[:, :, :filled], values[:, :, :filled], None), ref)
