"""The decode step's CPU kernels (kernels/cold.py) and the cold rows they read (runtime/cold_rows.py) against a
float64 numpy reference; the torch backend (kernels/ops.py) and the device's reads in place against the same reference.
"""

import zlib

import numpy as np
import pytest
import torch
from cold_ref import cold_ffn64
from hotneurons.kernels import cold as K
from hotneurons.kernels import ops
from hotneurons.kernels.names import ROW_DTYPES
from hotneurons.runtime import cold_rows as C


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
    gate = None if rows.gate is None else _widen64(rows.gate, rows.scale[0], rows.group)
    return cold_ffn64(act, x, idx, gate, _widen64(rows.up, rows.scale[1], rows.group), rows.b_up,
                      _widen64(rows.down_t, rows.scale[2], rows.group))


def random_rows(rng, act: str, d: int, n: int, dtype: str) -> C.ColdRows:
    w = lambda: torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d))  # noqa: E731
    gated = act in K.GATED
    b_up = None if gated else torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.1)
    return C.ColdRows.from_weights(w() if gated else None, w(), b_up, w(), dtype)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
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
    C.ffn_rows(act, x, idx, rows, out, part)
    ref = reference(act, x, idx, rows)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    # out of shape (0,): the sum left in the partial rows, for the GPU to add up; rows of threads with no neurons
    # (more rows than active neurons: "empty", "one") zeroed over stale values
    part = np.full((5, d), np.nan, np.float32)
    C.ffn_rows(act, x, idx, rows, np.empty(0, np.float32), part)
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


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_kernel_threads_do_not_change_the_result(dtype):
    rng = np.random.default_rng(1)
    d, n = 48, 200
    x = rng.standard_normal(d).astype(np.float32)
    rows = random_rows(rng, "swiglu", d, n, dtype)
    idx = np.arange(n, dtype=np.int64)
    outs = [C.ffn_rows("swiglu", x, idx, rows, np.empty(d, np.float32), np.empty((threads, d), np.float32))
            for threads in (1, 3, 7)]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_kernel_claims_cover_each_position_once(threads):
    """cold_ffn's claims (cold._claim): claim numbers 0, 1, ... take [0, k) in order, each position once, CHUNK at
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
    """The packed cold mask -> active positions (cold.bit_indices, one count-trailing-zeros per set bit) as
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
    """cold.cold_layer on the bool mask m packed (or on `bits`, its packed buffer, written elsewhere), over fresh
    scratch (NaN-filled: its contents must not matter) -> (k, out)."""
    n, d = m.shape[0], x.shape[0]
    out, part = np.full(d, np.nan, np.float32), np.full((3, d), np.nan, np.float32)
    words = (K.pack_mask(m) if bits is None else bits).view(np.uint64)
    k = K.cold_layer(ready, release, i, words, np.full(n, -1, np.int64), skip, x, rows.gate_arg, rows.up, rows.b_up,
                     rows.down_t, rows.scale, rows.group, part, out, K.ACT_CODE[act], marks)
    return k, out


@pytest.mark.parametrize("dtype", ROW_DTYPES)
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
    from hotneurons.kernels import dram

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
