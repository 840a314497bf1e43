"""Weights laid out for a placement, and the hybrid FFN module that replaces each decoder layer's FFN.

Per layer, `HybridFFN` holds
- hot neurons (placement gpu=True) as compact matrices on the compute device, in the model dtype:
  `gate_hot`, `up_hot` (n_hot, d_model), `down_t_hot` (n_hot, d_model) = down.weight[:, hot].T;
- cold neurons in CPU RAM, `cold` (cold_rows.ColdRows): one contiguous row per neuron of gate, up and down.T,
  (n_cold, d_model) each, as bfloat16 bit patterns or int8 with a scale per 64 weights (`cold_dtype`), read by Numba.
The original FFN modules are dropped, so the dense FFN weights never reach the device.

Decode (one token): the mask comes from the predictor (mode "predictor"), the true activations ("oracle") or is
all ones ("dense"); hot neurons are always computed (as pi-eval's placement mode does); x and the cold part of
the mask go to the CPU, the Numba kernel computes the active cold neurons while the device computes the hot
ones, and the CPU partial sum is added on the device. Prefill (several tokens) goes dense.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch
import torch.nn.functional as F
from hotneurons.common.models import LoadedModel
from hotneurons.profiler.hooks import active_mask
from hotneurons.runtime.cold_rows import ColdRows, ffn_rows_mapped, host_mapped, map_rows
from hotneurons.runtime.kernels import (
    ACT_CODE,
    GATED,
    NO_FLAGS,
    SPINS,
    cold_layer,
    ffn_rows,
    ffn_rows_torch,
    mask_bytes,
    neuron_values,
    wait_ready,
)
from torch import nn

MASKS = ("dense", "oracle", "predictor")
COLD_CHUNK = 4096  # cold rows widened to float32 at a time in dense prefill (bounds the temporary memory)


@dataclass(frozen=True)
class Placement:
    """Per layer a (n_neurons,) bool array: True = the neuron's rows live on the compute device."""

    gpu: tuple[np.ndarray, ...]

    @classmethod
    def uniform(cls, n_layers: int, n_neurons: int, on_gpu: bool) -> "Placement":
        return cls(tuple(np.full(n_neurons, on_gpu) for _ in range(n_layers)))

    @classmethod
    def from_run(cls, run_dir: str | Path, model_info: dict) -> "Placement":
        """RUN/placement/placement.parquet (refuses a placement made for another model)."""
        from hotneurons.predictors.evaluate import read_placement

        masks = read_placement(Path(run_dir), model_info, model_info["n_layers"])
        return cls(tuple(masks[i].numpy() for i in range(model_info["n_layers"])))

    def gpu_share(self) -> float:
        return float(np.mean([g.mean() for g in self.gpu]))


def nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


class HybridFFN(nn.Module):
    """One layer's FFN: hot rows by torch on the compute device, active cold rows by Numba on the CPU."""

    # CUDA: the GPU adds up the CPU threads' partial sums of the cold rows, read over PCIe (kernels.cold_ffn; False:
    # the CPU adds them, and the GPU reads the one row). Read when the host buffers are made (the first decode).
    sum_on_device = True

    def __init__(self, layer: int, activation: str, ffn: dict[str, nn.Linear], gpu: np.ndarray, mask: str,
                 predictor: nn.Module | None = None, tau: float | None = None, cold_dtype: str = "bf16"):
        super().__init__()
        if mask not in MASKS:
            raise ValueError(f"unknown mask source '{mask}': choose one of {', '.join(MASKS)}")
        if mask == "predictor" and predictor is None:
            raise ValueError(f"layer {layer}: mask 'predictor' needs a predictor")
        self.layer, self.activation, self.mask, self.tau = layer, activation, mask, tau
        self.gated = activation in GATED
        if self.gated and any(ffn[k].bias is not None for k in ("gate", "up")):
            raise ValueError(f"layer {layer}: this gated FFN has gate/up biases (e.g. mlp_bias=True), which the "
                             f"runtime does not compute yet: run it with HF transformers instead")
        up, down = ffn["up"].weight.detach(), ffn["down"].weight.detach()  # (n, d), (d, n)
        gate = ffn["gate"].weight.detach() if self.gated else None  # (n, d)
        b_up = None if ffn["up"].bias is None else ffn["up"].bias.detach()  # (n,)
        b_down = ffn["down"].bias
        self.n_neurons, self.d_model = up.shape
        gpu_t = torch.as_tensor(np.asarray(gpu, dtype=bool))
        hot, cold = torch.nonzero(gpu_t).flatten(), torch.nonzero(~gpu_t).flatten()
        self.n_hot, self.n_cold = len(hot), len(cold)
        self.register_buffer("up_hot", up[hot].clone())  # (n_hot, d)
        self.register_buffer("gate_hot", gate[hot].clone() if self.gated else None)  # (n_hot, d)
        self.register_buffer("b_up_hot", None if b_up is None else b_up[hot].clone())  # (n_hot,)
        self.register_buffer("down_t_hot", down[:, hot].T.contiguous())  # (n_hot, d)
        self.register_buffer("b_down", None if b_down is None else b_down.detach().clone())  # (d,)
        # cold rows in CPU RAM, contiguous per neuron: (n_cold, d) each
        self.cold = ColdRows.from_weights(gate[cold] if self.gated else None, up[cold],
                                          None if b_up is None else b_up[cold], down[:, cold].T, cold_dtype)
        self.all_cold = np.arange(self.n_cold, dtype=np.int64)
        # the compute device's share of the cold part: of a token's marked cold neurons (ascending ids) the device
        # computes the first `mapped_rows` from `mapped` (the cold rows, read in place over PCIe), the CPU the rest
        self.mapped: dict[str, Any] | None = None
        self.mapped_rows = 0
        self.cold_marks = np.zeros(2)  # decode tokens, marked cold neurons (host tally; picks mapped_rows)
        # the predictor's weights, fc2's rows in the order cold neurons, then hot ones: a token's cold masks are then
        # its first n_cold decisions, with no gather (predict)
        p = predictor
        self.register_buffer("pred_fc1", None if p is None else p.fc1.weight.detach())  # (hidden, d)
        fc2 = None if p is None else p.fc2.weight.detach()[torch.cat((cold, hot))]  # (n, hidden)
        self.register_buffer("pred_fc2", fc2)
        self.register_buffer("pred_threshold", None if p is None else p.threshold.detach())  # (1,) float32
        self.use_graphs = True  # CUDA: replay the per-token GPU work as two CUDA graphs (see _decode)
        self._f32: dict[str, torch.Tensor] | None = None  # float32 cold rows, built on demand (prefill, oracle)
        self._io: dict[str, Any] | None = None  # transfer buffers (pinned on CUDA), events, graphs
        self.counts = np.zeros(4)  # decode tokens, active neurons, active hot neurons, active cold neurons
        self._fired: torch.Tensor | None = None  # (n,) int32 predictor firings, pred_fc2's order, summed on device
        self.timing: list[dict] | None = None  # set to a list to record per-call timings

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def cold_bytes(self) -> int:
        return self.cold.nbytes()

    def reset_counts(self) -> None:
        self.counts[:] = 0
        if self._fired is not None:
            self._fired.zero_()

    def read_counts(self) -> np.ndarray:
        c = self.counts.copy()
        if self.mask == "predictor" and self._fired is not None:
            fired = self._fired.double()  # (n,) pred_fc2's order: cold neurons, then hot ones
            c[1:] += torch.stack([fired.sum(), fired[self.n_cold:].sum(), fired[:self.n_cold].sum()]).cpu().numpy()
        return c

    def _cold_f32(self) -> dict[str, torch.Tensor]:
        if self._f32 is None:
            self._f32 = self.cold.float32()
        return self._f32

    def _host_io(self, x: torch.Tensor) -> dict[str, Any]:
        """Host buffers the kernel reads and writes (pinned on CUDA, so copies are async), made on first decode."""
        if self._io is None:
            pin = x.device.type == "cuda"
            host_x = torch.empty(self.d_model, dtype=torch.float32, pin_memory=pin)  # (d,) FFN input on the host
            # (mask_bytes(n_cold),) the cold mask on the host as bits (bit b of byte i = cold neuron 8 i + b), zero
            # padded to whole uint64 words; the GPU writes the first ceil(n_cold / 8) bytes, the padding stays zero
            host_m = torch.zeros(mask_bytes(self.n_cold), dtype=torch.uint8, pin_memory=pin)
            # (threads, d) the kernel's per-thread partial sums; (d,) their sum, unless the GPU adds them up itself
            host_part = torch.zeros((numba.get_num_threads(), self.d_model), dtype=torch.float32, pin_memory=pin)
            on_device = pin and self.sum_on_device
            host_out = torch.empty(0 if on_device else self.d_model, dtype=torch.float32, pin_memory=pin)
            x_np, m_np, out_np, part = host_x.numpy(), host_m.numpy(), host_out.numpy(), host_part.numpy()
            # the same buffers as tensors on x's device (CUDA: mapped), so that kernels write x and the mask and read
            # the CPU's sums over PCIe themselves: no copy nodes and no dtype casts around them
            mapped = {k: host_mapped(a, a, x.device, register=False) for k, a in
                      (("x_mapped", x_np), ("m_mapped", m_np), ("cold", part if on_device else out_np[None]))}
            self._io = {"x": host_x, "x_np": x_np, "m_np": m_np, "out_np": out_np,  # the views hold the buffers alive
                        **mapped, "part": part, "graphs": None,
                        "m_words": m_np.view(np.uint64),  # (ceil(n_cold / 64),) the mask's bits as bit_indices reads
                        "idx": np.empty(self.n_cold, np.int64),  # (n_cold,) the active cold positions, first k
                        "m_dev": torch.ones(self.n_cold, dtype=torch.bool, device=x.device)}  # (n_cold,) on device
            self._fired = torch.zeros(self.n_neurons, dtype=torch.int32, device=x.device)
        return self._io

    def cold_sum(self) -> torch.Tensor:
        """(d,) float32 on the compute device: the CPU's cold rows' sum for the token, from the host buffers (CUDA:
        the GPU reads them over PCIe; the threads' partial sums, added up here, where sum_on_device)."""
        c = self._io["cold"]  # (rows, d): the threads' partial sums, or their sum
        return c[0] if c.shape[0] == 1 else c.sum(0)

    def map_cold(self, device: torch.device) -> None:
        """Make the cold rows readable by `device` in place (CUDA: page-locked, mapped); mapped_rows may then be set."""
        if self.mapped is None and self.n_cold:
            self.mapped = map_rows(self.cold, device)

    # -- compute -----------------------------------------------------------------------------------------------
    def _device_part(self, x: torch.Tensor) -> torch.Tensor:
        """Decode, on x's device: the hot rows, plus the first `mapped_rows` marked cold neurons read in place."""
        y = self._hot(x)
        if self.mapped_rows:
            m = self._io["m_dev"]  # (n_cold,) this token's cold mask
            k = self.mapped_rows
            ids = torch.nonzero_static(m, size=k, fill_value=0)[:, 0]  # (k,) the first k marked (padding: row 0)
            valid = torch.arange(k, device=m.device) < m.sum()  # (k,) fewer marked than k: the rest is padding
            y = y + ffn_rows_mapped(self.activation, x, ids, valid, self.mapped).to(y.dtype)
        return y

    def _hot(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, d) -> (tokens, d) from the hot rows (+ down bias), on x's device."""
        y = ffn_rows_torch(self.activation, x, self.gate_hot, self.up_hot, self.b_up_hot, self.down_t_hot) \
            if self.n_hot else torch.zeros_like(x)
        return y if self.b_down is None else y + self.b_down

    def _cold_dense(self, x: torch.Tensor) -> torch.Tensor:
        """All cold neurons for several tokens (prefill), float32 on the CPU: (tokens, d) -> (tokens, d)."""
        w = self._cold_f32()
        xc = x.detach().to("cpu", torch.float32)
        y = torch.zeros_like(xc)
        for s in range(0, self.n_cold, COLD_CHUNK):
            sl = slice(s, s + COLD_CHUNK)
            y += ffn_rows_torch(self.activation, xc, None if w["gate"] is None else w["gate"][sl], w["up"][sl],
                                w["b_up"][sl], w["down_t"][sl])
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.d_model)  # (tokens, d)
        if x2.shape[0] != 1:
            y = self._hot(x2)
            if self.n_cold:
                y = y + self._cold_dense(x2).to(y.device, y.dtype)
            return y.reshape(shape)
        return self._decode(x2).reshape(shape)

    def _to_host(self, x: torch.Tensor, predict_op=None) -> None:
        """x (1, d) and the predictor's cold mask into the host buffers (async on CUDA); firings counted on device.
        predict_op: predict (torch's kernels) or its Triton twin, fused.predict (two kernels)."""
        self._io["x_mapped"].copy_(x[0])  # one kernel: cast and write to the host
        if self.mask == "predictor":
            self._decide(x[0], predict_op or predict)

    def _decide(self, x: torch.Tensor, predict_op, fired: torch.Tensor | None = None,
                m_dev: torch.Tensor | None = None) -> None:
        """The predictor on x (d,) and its decision (predict_op) into the firing counts and the cold masks: the
        host's, and the device's where the device reads cold rows (mapped_rows). fired, m_dev: other buffers than the
        FFN's (a timing that must leave its counts alone)."""
        io = self._io
        predict_op(x.to(self.pred_fc1.dtype), self.pred_fc1, self.pred_fc2, self.pred_threshold,
                   self._fired if fired is None else fired,
                   (io["m_dev"] if m_dev is None else m_dev) if self.n_cold and self.mapped_rows else None,
                   io["m_mapped"] if self.n_cold else None, self.n_cold)

    def _capture(self, x: torch.Tensor) -> dict[str, Any]:
        """Two CUDA graphs per layer: `pre` (predictor, cold mask and x to the host) and `hot` (the hot rows).

        Eagerly, this GPU work is ~25 small kernel launches per layer and token, ~0.7 ms of CPU time that the CPU
        kernel then waits behind; replayed as graphs it is two launches."""
        xs = x.clone()  # (1, d) static input of both graphs
        fired = self._fired.clone()
        warm_up(x.device, lambda: (self._to_host(xs), self._device_part(xs)))
        self._fired.copy_(fired)  # the warm-up fired nothing real
        pre, hot = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(pre):
            self._to_host(xs)
        with torch.cuda.graph(hot, pool=pre.pool()):
            ys = self._device_part(xs)
        return {"x": xs, "y": ys, "pre": pre, "hot": hot, "copied": torch.cuda.Event()}

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """One token: (1, d) -> (1, d). On CUDA: GPU work enqueued, the CPU waits for x and the mask only, the Numba
        kernel computes the active cold rows while the GPU computes the hot ones, the partial sum is added on the GPU."""
        cuda = x.device.type == "cuda"
        io = self._host_io(x)
        ev0 = ev_hot0 = ev_hot1 = None
        if self.timing is not None and cuda:  # a common zero for GPU events and CPU clocks (timing runs only)
            ev0, ev_hot0, ev_hot1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            ev0.record()
            ev0.synchronize()
        t0 = time.perf_counter()
        if cuda and self.mask != "oracle":
            if io["graphs"] is None and self.use_graphs:
                io["graphs"] = self._capture(x)
            g = io["graphs"]
            if g is not None:
                g["x"].copy_(x)
                g["pre"].replay()
                g["copied"].record()
            else:  # eager: the same work as ~25 launches
                g = {"copied": torch.cuda.Event()}
                self._to_host(x)
                g["copied"].record()
            if ev_hot0 is not None:
                ev_hot0.record()
            if "hot" in g:
                g["hot"].replay()
                y = g["y"]
            else:
                y = self._device_part(x)
            if ev_hot1 is not None:
                ev_hot1.record()
            g["copied"].synchronize()  # the hot rows keep the GPU busy while the CPU works below
        else:
            self._to_host(x)
            if cuda:  # oracle: the host needs x now
                torch.cuda.current_stream(x.device).synchronize()
            y = None
        t1 = time.perf_counter()
        idx = self.cold_rows(x)
        t2 = time.perf_counter()
        if y is None:
            y = self._device_part(x)
        if self.n_cold:
            y = y + self.cold_sum().to(y.dtype)  # CUDA: kernels read the CPU's sums over PCIe, no copy node
        elif cuda:
            y = y.clone()  # a graph's static output is overwritten by the next token
        if self.timing is not None:
            if cuda:
                torch.cuda.synchronize(x.device)
            t3 = time.perf_counter()
            # ms from the FFN's start: the CPU kernel's interval and the GPU hot part's, for a timeline
            row = {"layer": self.layer, "active_cold": int(len(idx)) if self.n_cold else 0,
                   "cpu_start_ms": 1e3 * (t1 - t0), "cpu_end_ms": 1e3 * (t2 - t0), "ffn_ms": 1e3 * (t3 - t0),
                   "gpu_hot_start_ms": None, "gpu_hot_end_ms": None, "overlap_ms": 0.0}
            if ev_hot0 is not None:
                row["gpu_hot_start_ms"], row["gpu_hot_end_ms"] = ev0.elapsed_time(ev_hot0), ev0.elapsed_time(ev_hot1)
                row["overlap_ms"] = max(0.0, min(row["cpu_end_ms"], row["gpu_hot_end_ms"])
                                        - max(row["cpu_start_ms"], row["gpu_hot_start_ms"]))
            self.timing.append(row)
        return y

    def cold_rows(self, x: torch.Tensor, flags=None, i: int = -1) -> np.ndarray:
        """The CPU's part, once x (and the mask) are in the host buffers: the active cold rows' sum into io["out_np"],
        or (CUDA, sum_on_device) as the threads' partial sums into io["part"].
        Returns the active cold row indices (with the predictor: a view of a buffer that the next call overwrites).
        `flags` (fast.HostFlags) and layer `i`: first wait for the GPU's ready[i], and release flag i once the sum is
        written (the static decoder's prelaunched graphs); with the predictor both happen inside the one Numba call.
        `x` (1, d) on the device is read only by the oracle's hot count: other
        masks must not touch the GPU here, whose stream the static decoder holds meanwhile (runtime/fast.py)."""
        io = self._io
        ready, release = (flags.ready, flags.host) if flags is not None else (NO_FLAGS, NO_FLAGS)
        if self.mask == "predictor" and self.n_cold:
            c = self.cold
            k = cold_layer(ready, release, i if flags is not None else -1, io["m_words"], io["idx"], self.mapped_rows,
                           io["x_np"], c.gate_arg, c.up, c.b_up, c.down_t, c.scale, c.group, io["part"], io["out_np"],
                           ACT_CODE[self.activation], self.cold_marks)
            if k < 0:
                raise self._no_signal()
            self.counts[0] += 1
            return io["idx"][min(self.mapped_rows, k):k]
        if flags is not None and not wait_ready(ready, i, SPINS):
            raise self._no_signal()
        if self.mask == "dense":
            idx = self.all_cold
            self.counts += (1, self.n_neurons, self.n_hot, self.n_cold)
        elif self.mask == "predictor":  # no cold rows
            idx = self.all_cold
            self.counts[0] += 1
        else:  # oracle: the true activations, computed densely (a correctness check, not a speed path)
            idx = self._oracle(x, io["x"])
        self.cold_marks += (1, len(idx))
        idx = idx[self.mapped_rows:]  # the device computed the first mapped_rows
        if self.n_cold:
            ffn_rows(self.activation, io["x_np"], idx, self.cold, io["out_np"], io["part"])
        if flags is not None:
            flags.release(i)
        return idx

    def _no_signal(self) -> RuntimeError:
        return RuntimeError(f"layer {self.layer}: the GPU did not signal its x and cold mask within {SPINS:,} reads "
                            f"of the flag: a failed or stalled CUDA graph")

    def _oracle(self, x: torch.Tensor, x_host: torch.Tensor) -> np.ndarray:
        w = self._cold_f32()
        h_cold = neuron_values(self.activation, x_host[None], w["gate"], w["up"], w["b_up"])[0]  # (n_cold,)
        m_cold = active_mask(h_cold, self.tau)
        if self.n_hot:
            h_hot = neuron_values(self.activation, x, self.gate_hot, self.up_hot, self.b_up_hot)[0]  # (n_hot,)
            n_hot_active = int(active_mask(h_hot, self.tau).sum())
        else:
            n_hot_active = 0
        n_cold_active = int(m_cold.sum())
        self.counts += (1, n_hot_active + n_cold_active, n_hot_active, n_cold_active)
        return np.flatnonzero(m_cold.numpy())


def measure_pcie_rates(f: HybridFFN, rows: int = 2048, reps: int = 5) -> tuple[float, float]:
    """Cold rows/s of f that the device reads in place (over PCIe) and that the CPU reads from DRAM, each timed alone
    on fresh random rows (the best of `reps`: single CPU calls on the H100 host now and then took 20x longer). Needs
    f.map_cold first. Both read every row of a neuron here (SwiGLU, GELU: no zero gate skips a row)."""
    device = f.mapped["b_up"].device
    k = min(rows, f.n_cold)
    act = "swiglu" if f.gated else "gelu"
    rng = np.random.default_rng(0)
    sets = [np.sort(rng.choice(f.n_cold, k, replace=False)).astype(np.int64) for _ in range(2 * reps + 2)]
    x = torch.randn(1, f.d_model, generator=torch.Generator().manual_seed(0))
    xd, valid = x.to(device), torch.ones(k, dtype=torch.bool, device=device)
    out, part = np.zeros(f.d_model, np.float32), np.empty((numba.get_num_threads(), f.d_model), np.float32)

    def device_call(ids: np.ndarray) -> None:
        ffn_rows_mapped(act, xd, torch.from_numpy(ids).to(device), valid, f.mapped)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn, ids: np.ndarray) -> float:
        t = time.perf_counter()
        fn(ids)
        return time.perf_counter() - t

    cpu_call = lambda ids: ffn_rows(act, x[0].numpy(), ids, f.cold, out, part)  # noqa: E731
    device_call(sets[0])  # warm up (CUDA kernels, Numba compilation)
    cpu_call(sets[1])
    device_s = min(timed(device_call, s) for s in sets[2:2 + reps])  # s
    cpu_s = min(timed(cpu_call, s) for s in sets[2 + reps:])  # s
    return k / device_s, k / cpu_s


def predict(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, threshold: torch.Tensor, fired: torch.Tensor,
            m_dev: torch.Tensor | None, m_host: torch.Tensor | None, n_cold: int) -> None:
    """The predictor on one token and its decision. x (d,), fc1 (hidden, d), fc2 (rows, hidden), all in the model
    dtype: logits = fc2 relu(fc1 x), each rounded to that dtype as nn.Linear rounds; a row fires where its logit >=
    threshold (float32 (1,), rounded to the logits' dtype, as Predictor.mask compares). fired (rows,) int32 += the
    decisions; the first n_cold rows' decisions (HybridFFN orders fc2's rows cold neurons first), where given, into
    m_dev (n_cold,) bool and into m_host packed as bits, bit b of byte i = row 8 i + b (uint8, at least
    ceil(n_cold / 8) bytes: the first ceil(n_cold / 8) written, the bits past n_cold zero, the bytes after left
    alone; kernels.bit_indices reads them). fused.predict is its Triton twin."""
    logits = F.linear(torch.relu(F.linear(x, fc1)), fc2)  # (rows,)
    full = logits >= threshold.to(logits.dtype)  # (rows,) bool
    fired += full
    if m_dev is not None:
        m_dev.copy_(full[:n_cold])
    if m_host is not None:
        nb = -(-n_cold // 8)  # bytes of bits
        bits = F.pad(full[:n_cold].to(torch.uint8), (0, 8 * nb - n_cold)).view(nb, 8)  # (nb, 8) 0 or 1, zero padded
        # disjoint bits: their sum is their or
        torch.sum(bits << torch.arange(8, dtype=torch.uint8, device=bits.device), 1, dtype=torch.uint8,
                  out=m_host[:nb])


def warm_up(device: torch.device, fn, times: int = 2) -> None:
    """Run `fn` on a side stream and wait for it: what CUDA-graph capture needs first (lazy inits, autotuning)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


class _OnCPU(nn.Module):
    """A module `inner` kept in CPU RAM, out of the module tree (so that `model.to(device)` leaves it there), whose
    outputs go to the `home` device; its attributes read through (those the model reads, e.g. attention_type)."""

    def __init__(self, inner: nn.Module, device: torch.device | str):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        self.home = torch.device(device)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["inner"], name)


class OnCPULayer(_OnCPU):
    """A whole decoder layer run on the CPU in float32 (layer-split mode); inputs and outputs hop devices."""

    def __init__(self, layer: nn.Module, device: torch.device | str, dtype: torch.dtype):
        super().__init__(layer.to("cpu", torch.float32), device)
        self.home_dtype = dtype

    @staticmethod
    def _move(obj, device, dtype=None):
        if isinstance(obj, torch.Tensor):
            return obj.to(device, dtype) if (dtype is not None and obj.is_floating_point()) else obj.to(device)
        if isinstance(obj, (tuple, list)):
            return type(obj)(OnCPULayer._move(o, device, dtype) for o in obj)
        if isinstance(obj, dict):
            return {k: OnCPULayer._move(v, device, dtype) for k, v in obj.items()}
        return obj

    def forward(self, *args, **kwargs):
        args = self._move(args, "cpu", torch.float32)
        kwargs = self._move(kwargs, "cpu", torch.float32)
        out = self.inner(*args, **kwargs)
        return self._move(out, self.home, self.home_dtype)


class OnCPUEmbedding(_OnCPU):
    """An untied model's input embedding kept in CPU RAM: a token reads one row of it, so the row is looked up on
    the CPU and copied to the device (llama.cpp keeps its input embedding on the CPU for the same reason), and the
    table's bytes (LLaMA-2-70B: 0.5 GB) go to hot neurons instead. pi-solve counts it there (solver/cost.py)."""

    def __init__(self, embedding: nn.Module, device: torch.device | str):
        super().__init__(embedding.to("cpu"), device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids.to("cpu")).to(self.home)


def embedding_to_cpu(lm: LoadedModel, device: torch.device | str) -> OnCPUEmbedding | None:
    """Keep an untied model's input embedding in CPU RAM (OnCPUEmbedding); tied ones are the LM head too and stay."""
    emb = lm.model.get_input_embeddings()
    if isinstance(emb, OnCPUEmbedding):
        return emb
    if not lm.info["params"]["lm_head"]:
        return None
    lm.model.set_input_embeddings(OnCPUEmbedding(emb, device))
    return lm.model.get_input_embeddings()


def install(lm: LoadedModel, layer: int, module: nn.Module) -> None:
    """Put `module` in place of layer `layer`'s FFN, dropping the original FFN weights."""
    block = lm.layers[layer]
    ad = lm.adapter
    if ad.mlp:
        setattr(block, ad.mlp, module)
    else:  # OPT: fc1 -> act -> fc2 sit in the layer itself; the hybrid module takes fc2's place and x
        setattr(block, ad.up, nn.Identity())
        setattr(block, "activation_fn", nn.Identity())
        setattr(block, ad.down, module)


def count_bytes(lm: LoadedModel, ffns: list[HybridFFN], cpu_layers: list[OnCPULayer]) -> tuple[int, int]:
    """(bytes on the compute device incl. predictors, bytes in CPU RAM: cold rows, CPU-side layers and an untied
    input embedding)."""
    dev = nbytes(lm.model)
    cpu = sum(f.cold_bytes() for f in ffns) + sum(nbytes(c.inner) for c in cpu_layers)
    emb = lm.model.get_input_embeddings()
    return dev, cpu + (nbytes(emb.inner) if isinstance(emb, OnCPUEmbedding) else 0)
