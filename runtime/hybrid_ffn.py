"""`HybridFFN`, the module that replaces each decoder layer's FFN: hot rows by torch on the compute device, active cold
rows by Numba on the CPU.

Per layer it holds
- hot neurons (placement gpu=True) as compact matrices on the compute device: `gate_hot`, `up_hot` (n_hot, d_model),
  `down_t_hot` (n_hot, d_model) = down.weight[:, hot].T, in the compute dtype or a block format the GPU GEMVs read
  (`--gpu-dtype`: q4_0 / q4_1 / q8_0, the file's Q4_K / Q5_K / Q6_K; kernels/qlinear.py);
- cold neurons in CPU RAM, `cold` (cold_rows.ColdRows): one contiguous row per neuron of gate, up and down.T,
  (n_cold, d_model) each, in `cold_dtype`: bfloat16 bit patterns, int8 with a scale per 64 weights, llama.cpp's
  q8_0 / q4_0 / q4_1 blocks, or a K-quant file's gate and up rows as stored (down_t in a 32-weight format), read by
  Numba (kernels/cold.py, cold_q.py, cold_k.py).
The original FFN modules are dropped, so the dense FFN weights never reach the device. What it is built from (the
runtime's FFNLayout, the checks of a layer's arguments, the hot rows' setup) is runtime/ffn_setup.py's.

Decode (one token): the mask comes from the predictor (mode "predictor"), the true activations ("oracle") or is
all ones ("dense"). A predictor of the normed form reads the FFN input x; one of the powerinfer form
(predictors/form.py, `prenorm`) reads the residual before the pre-FFN norm: the static decoder passes its h2, and on
HF's layers a pre-hook on that norm (`watch_norm`) keeps it for the FFN's call that follows. Hot neurons are always
computed (as pi-eval's placement mode does); x and the cold part of the mask go to the CPU (`HostIO`,
runtime/host_io.py), the Numba kernel computes the active cold neurons while the device computes the hot ones, and the
CPU's partial sums are added on the device. Prefill (several tokens) goes dense. The static decoder
(runtime/static_decoder.py) calls the same pieces from its own graphs; `_decode` is the path of the other families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from hotneurons.common.ffn import active_mask
from hotneurons.kernels.cold import ACT_CODE, GATED, NO_FLAGS, SPINS, cold_layer, wait_ready
from hotneurons.kernels.cold_q import cold_layer_q
from hotneurons.kernels.ops import act_torch, ffn_rows_torch, gated_values, neuron_values, predict
from hotneurons.kernels.qlinear import linear
from hotneurons.models.ffn_weights import FFNWeights
from hotneurons.runtime.cold_rows import chunks, cold_rows_of, ffn_rows, ffn_rows_mapped, map_rows
from hotneurons.runtime.cuda import capture
from hotneurons.runtime.ffn_setup import FFNLayout, check_layer, hot_and_cold, layer_weights, set_hot_rows
from hotneurons.runtime.gated import gate_first, hot_sparse
from hotneurons.runtime.host_io import HostIO
from torch import nn

COLD_CHUNK = 4096  # cold rows widened at a time in dense prefill (bounds the temporary memory)


@dataclass(frozen=True)
class _Graphs:
    """The CUDA graphs of one token's GPU work outside the static decoder: eagerly it is ~25 small kernel launches a
    layer and token, CPU time that the cold kernel would wait behind; replayed it is two launches."""

    x: torch.Tensor  # (1, d) the static input of both graphs
    p: torch.Tensor | None  # (1, d) the static predictor input of `pre` (powerinfer form), else None: x
    y: torch.Tensor  # (1, d) the static output of `hot`
    pre: torch.cuda.CUDAGraph  # the predictor, the cold mask and x to the host
    hot: torch.cuda.CUDAGraph  # the hot rows (and the device's share of the cold ones)
    copied: torch.cuda.Event  # recorded after `pre`: what the CPU waits for


class HybridFFN(nn.Module):
    """One layer's FFN: hot rows by torch on the compute device, active cold rows by Numba on the CPU."""

    def __init__(self, layer: int, activation: str, ffn: FFNWeights | dict[str, nn.Linear], gpu: np.ndarray,
                 layout: FFNLayout, *, predictor: nn.Module | None = None, tau: float | None = None,
                 gate_taus: tuple[float, float] | None = None):
        """`ffn`: the layer's weights as stored (FFNWeights: float tensors or QTensors), or an HF layer's Linear
        modules; `gpu` (n,) bool: the neurons on the device; `layout` (ffn_setup.FFNLayout): the mask, formats and
        device, the same for every layer. `predictor`: mask 'predictor''s; `tau`: the activation threshold of a
        non-ReLU model (oracle masks); `gate_taus` (tau_g, tau_h): mask 'gate''s thresholds (common/gating.LayerTaus),
        applied to hot and cold neurons alike, prefill included."""
        super().__init__()
        check_layer(layer, activation, layout, predictor, gate_taus)
        self.layer, self.activation, self.mask, self.tau = layer, activation, layout.mask, tau
        # mask 'gate': (tau_g, tau_h) float32 values; None for every other mask (prefill then dense)
        self.taus = None if self.mask != "gate" else tuple(float(np.float32(t)) for t in gate_taus)
        self.gated = activation in GATED
        w = layer_weights(layer, ffn)
        self.n_neurons, self.d_model = w.shape
        hot, cold = hot_and_cold(gpu)  # (n_hot,), (n_cold,) neuron ids, ascending
        self.n_hot, self.n_cold = len(hot), len(cold)
        dev = layout.device or (w.up.device if isinstance(w.up, torch.Tensor) else "cpu")
        fdtype = layout.dtype or (w.up.dtype if isinstance(w.up, torch.Tensor) and w.up.is_floating_point()
                                  else torch.float32)
        self.compute_dtype = fdtype  # the hot rows' (x's at decode)
        set_hot_rows(self, w, hot, layout.gpu_dtype, dev, fdtype)  # hot_fmt, hot_q or up/gate/down_t_hot, sparse_hot
        self.register_buffer("tau_dev", None if self.taus is None else torch.tensor(self.taus, device=dev))  # (2,)
        self.gws: Any = None  # kernels/gated.GatedWorkspace (host_io makes it; Triton imported only where it runs)
        self.register_buffer("b_up_hot", None if w.b_up is None else w.b_up[hot].to(dev, fdtype))  # (n_hot,)
        self.register_buffer("b_down", None if w.b_down is None else w.b_down.to(dev, fdtype))  # (d,)
        # cold rows in CPU RAM, contiguous per neuron: (n_cold, d) each; rows already in cold_dtype's block format
        # (a GGUF's gate and up rows) are copied byte for byte
        self.cold = cold_rows_of(w, cold, layout.cold_dtype, self.gated, work=dev)
        self.all_cold = np.arange(self.n_cold, dtype=np.int64)  # (n_cold,)
        # the compute device's share of the cold part: of a token's marked cold neurons (ascending ids) the device
        # computes the first `mapped_rows` from `mapped` (the cold rows, read in place over PCIe), the CPU the rest
        self.mapped: dict[str, Any] | None = None
        self.mapped_rows = 0
        self.cold_marks = np.zeros(2)  # decode tokens, marked cold neurons (host tally; picks mapped_rows)
        # the predictor's weights, fc2's rows in the order cold neurons, then hot ones: a token's cold masks are then
        # its first n_cold decisions, with no gather (predict)
        p = predictor
        fc1 = None if p is None else p.fc1.weight.detach()  # (hidden, d)
        fc2 = None if p is None else p.fc2.weight.detach()[torch.cat((cold, hot))]  # (n, hidden)
        self.pred_dtype = None if p is None else fc1.dtype  # what the predictor's input is cast to
        if p is not None and layout.predictor_dtype != "auto":  # blocks the GEMV reads: not buffers
            from hotneurons.runtime.ffn_setup import predictor_blocks

            self.pred_fc1, self.pred_fc2 = predictor_blocks(fc1.to(dev), fc2.to(dev), layout.predictor_dtype)
        else:
            self.register_buffer("pred_fc1", fc1)
            self.register_buffer("pred_fc2", fc2)
        self.register_buffer("pred_threshold", None if p is None else p.threshold.detach())  # (1,) float32
        self.prenorm = layout.prenorm and p is not None  # the predictor reads the residual before the pre-FFN norm
        self.residual: torch.Tensor | None = None  # (..., d) that residual, from watch_norm's hook (HF's layers)
        self.use_graphs = layout.graphs  # CUDA: replay the per-token GPU work as two CUDA graphs (_Graphs)
        self.io: HostIO | None = None
        self._graphs: _Graphs | None = None
        self.counts = np.zeros(4)  # decode tokens, active neurons, active hot neurons, active cold neurons
        self.fired: torch.Tensor | None = None  # (n,) int32 predictor firings, pred_fc2's order, summed on device
        # mask 'gate': (n_hot,) int32 passes of the hot neurons in decode, summed on the device (no host sync)
        self.hot_passed: torch.Tensor | None = None
        self._gate_args: tuple | None = None  # mask 'gate': sparse_layer's row maps, scratch and codes (made once)
        # called with (self, mark) at the marks of a decode outside the static decoder ("start", "hot_start",
        # "hot_end", "cpu_start", "cpu_end", "end"), for timelines (bench/runtime_gpu_check.py); generate then
        # decodes through HF, whose FFN calls these marks are in
        self.probe: Callable[[HybridFFN, str], None] | None = None

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def cold_bytes(self) -> int:
        return self.cold.nbytes()

    def reset_counts(self) -> None:
        self.counts[:] = 0
        for t in (self.fired, self.hot_passed):
            if t is not None:
                t.zero_()

    def read_counts(self) -> np.ndarray:
        c = self.counts.copy()
        if self.mask == "gate" and self.hot_passed is not None:
            hot = float(self.hot_passed.sum())
            c[1:3] += hot
        if self.mask == "predictor" and self.fired is not None:
            fired = self.fired.double()  # (n,) pred_fc2's order: cold neurons, then hot ones
            c[1:] += torch.stack([fired.sum(), fired[self.n_cold:].sum(), fired[:self.n_cold].sum()]).cpu().numpy()
        return c

    def _cold_chunks(self, device: torch.device, dtype: torch.dtype = torch.float32):
        """The cold rows on `device`, COLD_CHUNK rows at a time (prefill, oracle): never a float copy of them all."""
        return chunks(self.cold, COLD_CHUNK, device, dtype)

    def host_io(self, device: torch.device) -> HostIO:
        """The host buffers (HostIO) and the firing counts, made once, before any graph that uses them is captured."""
        if self.io is None:
            self.io = HostIO.make(self.d_model, self.n_cold, device)
            self.fired = torch.zeros(self.n_neurons, dtype=torch.int32, device=device)
            self.hot_passed = torch.zeros(self.n_hot, dtype=torch.int32, device=device)
            if self.sparse_hot:
                from hotneurons.kernels.gated import GatedWorkspace

                self.gws = GatedWorkspace.make(self.n_hot, self.d_model, device, self.compute_dtype)
        return self.io

    def cold_sum(self) -> torch.Tensor:
        """(d,) float32 on the compute device: the CPU's cold rows' sum for the token (HostIO.cold_sum)."""
        return self.io.cold_sum()

    def map_cold(self, device: torch.device) -> None:
        """Make the cold rows readable by `device` in place (CUDA: page-locked, mapped); mapped_rows may then be set."""
        if self.mapped is None and self.n_cold:
            self.mapped = map_rows(self.cold, device)

    def reset_graphs(self) -> None:
        """Drop this FFN's own graphs (e.g. after mapped_rows changed): the next decode captures them again."""
        self._graphs = None

    # -- the device's part -------------------------------------------------------------------------------------
    def device_part(self, x: torch.Tensor) -> torch.Tensor:
        """Decode, on x's device: the hot rows, plus the first `mapped_rows` marked cold neurons read in place."""
        y = hot_sparse(self, x) if self.gws is not None else self._hot(x, count=True)
        return y + self.mapped_part(x).to(y.dtype) if self.mapped_rows else y

    def mapped_part(self, x: torch.Tensor) -> torch.Tensor:
        """(1, d): the first `mapped_rows` cold neurons of the token's mask (to_host wrote it), read in place."""
        m = self.io.mask_dev  # (n_cold,) this token's cold mask
        k = self.mapped_rows
        ids = torch.nonzero_static(m, size=k, fill_value=0)[:, 0]  # (k,) the first k marked (padding: row 0)
        valid = torch.arange(k, device=m.device) < m.sum()  # (k,) fewer marked than k: the rest is padding
        return ffn_rows_mapped(self.activation, x, ids, valid, self.mapped)

    def _hot_values(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, d) -> (tokens, n_hot) the hot neurons' values (mask 'gate': zero where they do not pass)."""
        if self.hot_q is None:
            return neuron_values(self.activation, x, self.gate_hot, self.up_hot, self.b_up_hot, self.taus)
        q = self.hot_q
        up = linear(x, q["up"], self.b_up_hot)  # (tokens, n_hot)
        if not self.gated:
            return act_torch(self.activation, up)
        g = linear(x, q["gate"])  # (tokens, n_hot)
        return act_torch(self.activation, g, up) if self.taus is None else gated_values(self.activation, g, up,
                                                                                         self.taus)

    def _hot(self, x: torch.Tensor, count: bool = False) -> torch.Tensor:
        """(tokens, d) -> (tokens, d) from the hot rows (+ down bias), on x's device; `count`: add the passing hot
        neurons to hot_passed (mask 'gate', decode)."""
        if not self.n_hot:
            y = torch.zeros_like(x)
        elif self.hot_q is None and self.taus is None:
            y = ffn_rows_torch(self.activation, x, self.gate_hot, self.up_hot, self.b_up_hot, self.down_t_hot)
        else:
            h = self._hot_values(x)  # (tokens, n_hot)
            if count and self.hot_passed is not None:
                self.hot_passed += (h != 0).sum(0, dtype=torch.int32)
            if self.hot_q is None:
                y = h @ self.down_t_hot  # (tokens, d)
            elif self.hot_q["down"] is None:  # neuron-major down rows (sparse_hot): widened a chunk at a time
                dt = self.hot_q["down_t"]
                y = sum(h[:, r:r + COLD_CHUNK] @ dt.rows(slice(r, r + COLD_CHUNK)).dequantize(h.dtype)
                        for r in range(0, self.n_hot, COLD_CHUNK))
            else:  # the down projection's hot columns, padded with zeros to whole blocks
                h = torch.nn.functional.pad(h, (0, self.hot_q["down_cols"] - self.n_hot))
                y = linear(h, self.hot_q["down"])  # (tokens, d)
        return y if self.b_down is None else y + self.b_down

    def watch_norm(self, norm: nn.Module):
        """HF's layers (powerinfer form): a pre-hook on the layer's pre-FFN norm keeps its input, the residual, for
        the predictor of the FFN call that follows. Returns the hook's handle."""
        def hook(_mod, args):
            self.residual = args[0]  # (..., d)
        return norm.register_forward_pre_hook(hook)

    def predictor_input(self, x: torch.Tensor) -> torch.Tensor:
        """(1, d): what the predictor reads for the token whose FFN input is x: x, or the residual watch_norm kept."""
        if not self.prenorm:
            return x
        r, self.residual = self.residual, None  # used once: a stale residual must never reach a later token
        if r is None:
            raise RuntimeError(f"layer {self.layer}: the powerinfer-form predictor reads the residual before the "
                               f"pre-FFN norm, and no hook on that norm saw it (watch_norm)")
        return r.reshape(1, -1)

    def to_host(self, x: torch.Tensor, predict_op: Callable = predict, pred_x: torch.Tensor | None = None) -> None:
        """x (1, d) and the predictor's cold mask into the host buffers (async on CUDA); firings counted on device.
        predict_op: ops.predict (torch's kernels) or one of its Ops twins; pred_x (1, d): the predictor's input where
        it is not x (the powerinfer form's residual before the pre-FFN norm)."""
        self.io.x_dev.copy_(x[0])  # one kernel: cast and write to the host
        if self.mask == "predictor":
            self.decide((x if pred_x is None else pred_x)[0], predict_op)

    def decide(self, x: torch.Tensor, predict_op: Callable, fired: torch.Tensor | None = None,
               mask_dev: torch.Tensor | None = None) -> None:
        """The predictor on x (d,) and its decision (predict_op) into the firing counts and the cold masks: the
        host's, and the device's where the device reads cold rows (mapped_rows). fired, mask_dev: other buffers than
        the FFN's (a timing that must leave its counts alone)."""
        io = self.io
        if not isinstance(self.pred_fc1, torch.Tensor):  # blocks (--predictor-dtype q8_0): torch's op reads them
            predict_op = predict
        predict_op(x.to(self.pred_dtype), self.pred_fc1, self.pred_fc2, self.pred_threshold,
                   self.fired if fired is None else fired,
                   (io.mask_dev if mask_dev is None else mask_dev) if self.n_cold and self.mapped_rows else None,
                   io.mask_dev_bits if self.n_cold else None, self.n_cold)

    # -- compute -----------------------------------------------------------------------------------------------
    def _cold_dense(self, x: torch.Tensor) -> torch.Tensor:
        """All cold neurons for several tokens (prefill): (tokens, d) -> (tokens, d) float32 on x's device, the rows
        streamed a chunk at a time to where x is. On CUDA the products run in x's dtype, as the hot rows' and a dense
        model's do (float32 products there run without tensor cores: most of a 70B's prefill), the chunks' sums
        added in float32."""
        dtype = x.dtype if x.device.type == "cuda" else torch.float32
        xc = x.detach().to(dtype)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (tokens, d)
        for w in self._cold_chunks(xc.device, dtype):
            w = {k: None if v is None else v.to(dtype) for k, v in w.items()}  # b_up, float rows: float32
            y += ffn_rows_torch(self.activation, xc, w["gate"], w["up"], w["b_up"], w["down_t"], self.taus)
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

    def _capture(self, x: torch.Tensor, p: torch.Tensor) -> _Graphs:
        xs = x.clone()  # (1, d)
        ps = p.clone() if self.prenorm else None  # (1, d)
        (pre, hot), (_, y) = capture(x.device, (lambda: self.to_host(xs, predict, ps), lambda: self.device_part(xs)),
                                     keep=[t for t in (self.fired, self.hot_passed) if t is not None])
        return _Graphs(xs, ps, y, pre, hot, torch.cuda.Event())

    def _mark(self, mark: str) -> None:
        if self.probe is not None:
            self.probe(self, mark)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """One token: (1, d) -> (1, d). On CUDA: GPU work enqueued, the CPU waits for x and the mask only, the Numba
        kernel computes the active cold rows while the GPU computes the hot ones, the partial sums are added on the
        GPU."""
        cuda = x.device.type == "cuda"
        self.host_io(x.device)
        self._mark("start")
        p = self.predictor_input(x)  # (1, d)
        y = None
        if cuda and self.mask != "oracle":
            if self._graphs is None and self.use_graphs:
                self._graphs = self._capture(x, p)
            g = self._graphs
            copied = g.copied if g is not None else torch.cuda.Event()
            if g is not None:
                g.x.copy_(x)
                if g.p is not None:
                    g.p.copy_(p)
                g.pre.replay()
            else:  # eager: the same work as ~25 launches
                self.to_host(x, predict, p)
            copied.record()
            self._mark("hot_start")
            if g is not None:
                g.hot.replay()
                y = g.y
            else:
                y = self.device_part(x)
            self._mark("hot_end")
            copied.synchronize()  # the hot rows keep the GPU busy while the CPU works below
        else:
            self.to_host(x, predict, p)
            if cuda:  # oracle: the host needs x now
                torch.cuda.current_stream(x.device).synchronize()
        self._mark("cpu_start")
        self.cold_rows(x)
        self._mark("cpu_end")
        if y is None:
            y = self.device_part(x)
        if self.n_cold:
            y = y + self.cold_sum().to(y.dtype)  # CUDA: kernels read the CPU's sums over PCIe, no copy node
        elif cuda:
            y = y.clone()  # a graph's static output is overwritten by the next token
        self._mark("end")
        return y

    def cold_rows(self, x: torch.Tensor, flags=None, i: int = -1) -> np.ndarray:
        """The CPU's part, once x (and the mask) are in the host buffers: the active cold rows' sum into io.out, or
        (CUDA) as the threads' partial sums into io.part.
        Returns the active cold row indices (with the predictor: a view of a buffer that the next call overwrites).
        `flags` (cuda.HostFlags) and layer `i`: first wait for the GPU's ready[i], and release flag i once the sum is
        written (the static decoder's prelaunched graphs); with the predictor both happen inside the one Numba call.
        `x` (1, d) on the device is read only by the oracle's hot count: other masks must not touch the GPU here,
        whose stream the static decoder holds meanwhile."""
        io = self.io
        ready, release = (flags.ready, flags.host) if flags is not None else (NO_FLAGS, NO_FLAGS)
        if self.mask == "gate" and self.n_cold:
            k = gate_first(self, ready, release, i if flags is not None else -1)
            if k < 0:
                raise self._no_signal()
            self.counts += (1, k, 0, k)
            self.cold_marks += (1, k)
            return self._gate_args[2][:k]  # the passing cold neurons' down_t rows (sparse_layer's idx)
        if self.mask == "predictor" and self.n_cold:
            c, layer = self.cold, i if flags is not None else -1
            # Numba's njit takes arrays and scalars, not Python objects (no dataclass of the rows passes into it),
            # hence the long argument lists: written once, here, the kernels' one caller outside their tests
            if c.fmt:  # rows in Q4_0 / Q4_1 / Q8_0 blocks or K-quants (cold_q)
                k = cold_layer_q(ready, release, layer, io.mask_words, io.idx, self.mapped_rows, io.x_np, c.gate_arg,
                                 c.up, c.b_up, c.down_t, io.part, io.out, ACT_CODE[self.activation], self.cold_marks,
                                 fmt=c.code)
            else:
                k = cold_layer(ready, release, layer, io.mask_words, io.idx, self.mapped_rows, io.x_np, c.gate_arg,
                               c.up, c.b_up, c.down_t, c.scale, c.group, io.part, io.out, ACT_CODE[self.activation],
                               self.cold_marks)
            if k < 0:
                raise self._no_signal()
            self.counts[0] += 1
            return io.idx[min(self.mapped_rows, k):k]
        if flags is not None and not wait_ready(ready, i, SPINS):
            raise self._no_signal()
        if self.mask == "dense":
            idx = self.all_cold
            self.counts += (1, self.n_neurons, self.n_hot, self.n_cold)
        elif self.mask in ("predictor", "gate"):  # no cold rows
            idx = self.all_cold
            self.counts[0] += 1
        else:  # oracle: the true activations, computed densely (a correctness check, not a speed path)
            idx = self._oracle(x, io.x)
        self.cold_marks += (1, len(idx))
        idx = idx[self.mapped_rows:]  # the device computed the first mapped_rows
        if self.n_cold:
            ffn_rows(self.activation, io.x_np, idx, self.cold, io.out, io.part)
        if flags is not None:
            flags.release(i)
        return idx

    def _no_signal(self) -> RuntimeError:
        return RuntimeError(f"layer {self.layer}: the GPU did not signal its x and cold mask within {SPINS:,} reads "
                            f"of the flag: a failed or stalled CUDA graph")

    def _oracle(self, x: torch.Tensor, x_host: torch.Tensor) -> np.ndarray:
        h_cold = torch.cat([neuron_values(self.activation, x_host[None], w["gate"], w["up"], w["b_up"])[0]
                            for w in self._cold_chunks(torch.device("cpu"))] or [torch.zeros(0)])  # (n_cold,)
        m_cold = active_mask(h_cold, self.tau)
        if self.n_hot:
            h_hot = self._hot_values(x)[0]  # (n_hot,)
            n_hot_active = int(active_mask(h_hot, self.tau).sum())
        else:
            n_hot_active = 0
        n_cold_active = int(m_cold.sum())
        self.counts += (1, n_hot_active + n_cold_active, n_hot_active, n_cold_active)
        return np.flatnonzero(m_cold.numpy())
