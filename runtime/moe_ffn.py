"""`HybridMoE`, the module that replaces a mixture of experts' FFN in our decoder (as HybridFFN replaces a dense one):
the router, the shared expert and the GPU experts (a placement mask over the layer's experts) on the compute device,
the routed cold experts on the CPU, read in place from the file's stacked rows by the Numba kernels of
kernels/cold_experts.py.

A call, for T tokens x (T, d):
1. the router's logits and top-k (models/moe.route, as the reference models/moe.moe_ffn routes) on the device; the
   shared expert (Qwen2-MoE) is enqueued too, as it needs no routing;
2. the routed ids and weights (T, k) and x go to the host (pinned buffers on CUDA; the one wait of the layer);
3. the pairs (token, expert) on GPU experts are grouped per expert and computed on the device: a decode token's by
   the Triton GEMV over each expert's stored rows; a prefill's in three launches of kernels/grouped.py over all the
   pairs at once (gate, up, down: each expert's rows de-quantized inside the kernel), where the device's stacks are
   Q4_0 / Q4_1 / Q8_0 GpuQs or floats; otherwise (K-quants, and a CPU run, whose "device" is the CPU and its experts
   the file's rows in place) each expert's tokens in one product of its rows (`linear`);
4. the cold pairs, grouped per expert, by `experts_ffn` on the CPU: on CUDA the device's launches of step 3 are
   asynchronous, so the GPU computes its experts while the Numba kernel (GIL released) computes the CPU's;
5. the CPU's sum (T, d) goes back to the device and is added there.
Decode (T = 1) and prefill (T > 1) run the same steps: prefill batches each expert's tokens on either side.

Cold experts' rows: the file's stacked (E * n, d) / (E * d, n) rows as stored where the kernel reads them (Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16: numpy views of the mmapped bytes, nothing copied; moe_rows.KERNEL_FMTS);
other block formats (Q5_0, IQ4_XS, ...) are re-quantized, the cold experts only, into their nearest format
(weights/formats.py), into a compact stack.
ReLU-family experts (relu, reglu, drelu) also get their cold experts' down neuron-major (`down_t`,
runtime/moe_down_t.py: a second quantization of down for block formats), and a decode token's cold experts then
compute only their firing neurons (kernels/cold_experts_sparse.py: an inactive neuron's up and down rows are not read),
token by token at a short prefill too, so that the file's down pages of cold experts stay unread. A long prefill on
CUDA computes the cold experts on the device (runtime/moe_prefill.py: their rows copied as stored, down_t's for down).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
from hotneurons.kernels import cold_q, qlinear
from hotneurons.kernels.cold import ACT_CODE, FIRST_GATED, NO_FLAGS, SPINS, wait_ready
from hotneurons.kernels.cold_experts import CODE, experts_ffn, experts_layer_q, row_format
from hotneurons.kernels.cold_experts_sparse import scratch, sparse_layer, sparse_layer_predicted
from hotneurons.kernels.qlinear import GpuQ, linear, linear_rows
from hotneurons.models.common import Loader, WeightFn, _pack, ffn_values
from hotneurons.models.config import ModelConfig
from hotneurons.models.moe import route
from hotneurons.runtime import moe_prefill
from hotneurons.runtime.host_io import MoEHostIO
from hotneurons.runtime.moe_down_t import build_down_t, wants_down_t
from hotneurons.runtime.moe_rows import KERNEL_FMTS, PROJ, fmt_name, host_rows, nbytes, requantized, rows2d, unread_rows
from hotneurons.weights.names import layer_name
from hotneurons.weights.qtensor import QTensor
from torch import nn

GROUPED_DEVICES = ("cuda",)  # devices whose prefill runs kernels/grouped.py (the tests add "cpu": its torch path)


class HybridMoE(nn.Module):
    """One layer's mixture of experts: router, shared expert and GPU experts on the device, cold experts on the CPU."""

    def __init__(self, layer: int, cfg: ModelConfig, weights: WeightFn, gpu: np.ndarray,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 release: Any = None, release_rows: Any = None):
        """weights: canonical name -> tensor (a GGUF / safetensors source's get: experts stacked, QTensors of
        (E * out, in) rows or float (E, out, in)); gpu (E,) bool: the experts kept on `device`. `release` is told the
        router's and shared expert's names once copied; `release_rows` (a source's release_view) each view of expert
        rows this layer never reads again once loaded (moe_rows.unread_rows)."""
        super().__init__()
        if not cfg.moe:
            raise ValueError(f"layer {layer}: {cfg.model_type} has no experts: its FFN is HybridFFN's")
        gpu = np.asarray(gpu, dtype=bool)
        E = cfg.n_experts
        if gpu.shape != (E,):
            raise ValueError(f"layer {layer}: the expert placement has {gpu.shape} entries, the layer {E} experts")
        self.layer, self.cfg, self.gpu = layer, cfg, gpu
        self.device, self.dtype = torch.device(device), dtype
        self.d_model, self.n_ff = cfg.d_model, cfg.n_ff_exp
        self.activation = str(cfg.activation)
        load = Loader(weights, self.device, dtype, release)
        p = layer_name(layer, "ffn_")
        self.router = load.tensor(p + "gate_inp.weight")  # (E, d) in dtype, as the reference routes
        self.shared = None
        if cfg.n_ff_shexp:
            self.shared = (load.matrix(p + "gate_shexp.weight"), load.matrix(p + "up_shexp.weight"),
                           load.matrix(p + "down_shexp.weight"), load.tensor(p + "gate_inp_shexp.weight"))
        stacked = {k: weights(f"{p}{k}_exps.weight") for k in PROJ}
        outs = {"gate": self.n_ff, "up": self.n_ff, "down": self.d_model}  # rows an expert, per projection
        self.gpu_ids, self.cold_ids = np.flatnonzero(gpu), np.flatnonzero(~gpu)
        self.n_cold = len(self.cold_ids)  # the runtime's bookkeeping reads n_cold, mapped_rows (HybridFFN's)
        self.mapped_rows = 0
        self.stacks: dict[str, Any] = {}  # projection -> the device experts' rows, stacked
        self.lut = torch.full((E,), -1, dtype=torch.long, device=self.device)  # expert id -> stack index; -1: cold
        self.lut_np = np.full(E, -1, np.int64)  # the same on the host (the grouped prefill's groups)
        self.experts = self._device_experts(stacked, outs)  # expert id -> (gate, up, down) on the device
        # the cold experts' rows on the host: the file's own (cold_map the identity) or a compact re-quantized stack
        self.cold_map = np.full(E, -1, np.int64)  # expert id -> its index in the cold rows
        in_place = all(fmt_name(w) in KERNEL_FMTS and w.device.type == "cpu" for w in stacked.values())
        if not self.n_cold:
            self.cold = None
        elif in_place:
            self.cold = tuple(host_rows(rows2d(stacked[k], outs[k])) for k in PROJ)
            self.cold_map[:] = np.arange(E)
        else:
            self.cold = tuple(requantized(stacked[k], self.cold_ids, outs[k]) for k in PROJ)
            self.cold_map[self.cold_ids] = np.arange(self.n_cold)
        self.in_place = in_place
        # the stored formats of the rows in place (kernels/cold_experts.row_format's `fmt`: a K-quant's rows are as wide
        # as another format's); re-quantized rows are told by their width
        self.cold_fmts = tuple(fmt_name(stacked[k]) for k in PROJ) if in_place else (None, None, None)
        # ReLU-family experts: the cold experts' down neuron-major, so that decode skips an inactive neuron's down row
        self.down_t = None  # (n_cold * n, row) cold expert c's neuron j at row c * n + j, in the cold down's format
        self.dt_of = np.full(E, -1, np.int64)  # expert id -> its index in down_t; -1: on the device (or no down_t)
        if self.cold is not None and wants_down_t(self.activation, self.cold[2], self.d_model, self.n_ff,
                                                  self.cold_fmts[2]):
            self.down_t = build_down_t(stacked["down"], self.cold[2], self.cold_ids, self.d_model, self.n_ff,
                                       self.cold_fmts[2])
            self.dt_of[self.cold_ids] = np.arange(self.n_cold)
        if release_rows is not None:  # as each layer loads, so that the peak does not hold them either
            for v in unread_rows(stacked, outs, self.gpu_ids, self.cold_ids, self.device.type != "cpu", in_place,
                                 self.down_t is not None):
                release_rows(v)
        self._sparse_args: tuple | None = None  # sparse_layer's arguments (made at the first decode)
        self.expert_predictors = None  # runtime/expert_predictors.LayerPredictors (attach): marked neurons only
        self.counts = np.zeros(4)  # decode tokens, routed pairs, pairs on GPU experts, pairs on cold experts
        self.cold_active = 0  # decode (down_t layers): the routed cold experts' firing neurons, summed over tokens
        self.expert_counts = np.zeros(E, np.int64)  # decode: tokens routed to each expert
        self.probe = None  # HybridFFN's timeline marks: none here
        self.prenorm, self.residual = False, None
        self.mask = "router"  # the graph steps' runner asks (an oracle mask holds back its prelaunch)
        self.io: MoEHostIO | None = None
        self._layer_args: tuple | None = None  # experts_layer_q's arguments (host_io), block rows only
        self.fired: torch.Tensor | None = None  # (E,) int32 decode tokens routed to each expert, counted on device

    def _device_experts(self, stacked: dict, outs: dict) -> dict[int, tuple]:
        """The GPU experts' (gate, up, down) weights on the device, by expert id: on CUDA their rows gathered into one
        stack per projection (GpuQ for Q4_0 / Q4_1 / Q8_0, the compute dtype for floats), each expert a view; on a
        CPU run views of the file's rows (nothing copied)."""
        ids, dev = self.gpu_ids, self.device
        if not len(ids):
            return {}
        per: dict[str, list] = {}
        lut = np.full(self.cfg.n_experts, -1, np.int64)  # expert id -> its index in the device stacks; -1: cold
        lut[ids] = ids if dev.type == "cpu" else np.arange(len(ids))
        self.lut, self.lut_np = torch.from_numpy(lut).to(dev), lut  # (E,) each
        for k in PROJ:
            w, out = rows2d(stacked[k], outs[k]), outs[k]
            if dev.type == "cpu":  # in place: an expert is a row range
                stack, local = w, ids
            else:
                rows = torch.cat([torch.arange(e * out, (e + 1) * out) for e in ids])  # (E_g * out,)
                stack = (_pack(w.rows(rows), dev) if isinstance(w, QTensor)
                         else w.index_select(0, rows).to(dev, self.dtype))
                local = np.arange(len(ids))
            self.stacks[k] = stack  # (E_g * out, in): the graph steps gather the routed experts' rows from it
            per[k] = [stack.rows(slice(j * out, (j + 1) * out)) if isinstance(stack, (QTensor, GpuQ))
                      else stack[j * out:(j + 1) * out] for j in local]
        return {int(e): (per["gate"][i], per["up"][i], per["down"][i]) for i, e in enumerate(ids)}

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def cold_bytes(self) -> int:
        """Bytes of the cold experts' rows in host memory: their stored rows (in place: the file's pages of those
        experts, of which decode leaves down unread where there is a down_t) plus down_t (anonymous memory)."""
        if self.cold is None:
            return 0
        dt = 0 if self.down_t is None else self.down_t.nbytes
        dt += 0 if self.expert_predictors is None else self.expert_predictors.nbytes
        if not self.in_place:
            return sum(a.nbytes for a in self.cold) + dt
        return sum(a.nbytes * self.n_cold // self.cfg.n_experts for a in self.cold) + dt

    def device_bytes(self) -> int:
        """Bytes on the compute device: the router, the shared expert and the GPU experts."""
        shared = sum(nbytes(w) for w in self.shared) if self.shared is not None else 0
        return nbytes(self.router) + shared + sum(nbytes(w) for ws in self.experts.values() for w in ws)

    def reset_counts(self) -> None:
        self.counts[:] = 0
        self.expert_counts[:] = 0
        self.cold_active = 0

    def read_counts(self) -> np.ndarray:
        """(tokens, active, active on the GPU, active on the CPU) in neurons: a routed pair is an expert's n_ff (the
        neurons a dense expert computes; where a layer has down_t, `cold_active` counts the cold ones that fired)."""
        c = self.counts.copy()
        c[1:] *= self.n_ff
        return c

    # -- compute -----------------------------------------------------------------------------------------------
    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """(m, d) -> (m, d) expert e's FFN on the device, all its neurons."""
        g, u, dn = self.experts[e]
        return linear(ffn_values(self.cfg, linear(x, u), linear(x, g)), dn)

    def _grouped_applies(self, x: torch.Tensor) -> bool:
        """Whether a prefill's GPU experts run kernels/grouped.py: x's device takes it and its kernel reads the
        stacks (Q4_0 / Q4_1 / Q8_0 GpuQs, floats; a CPU run's stacks are the file's blocks, which it does not)."""
        if x.device.type not in GROUPED_DEVICES:
            return False
        from hotneurons.kernels import grouped  # Triton: imported where a prefill uses it

        return all(grouped.kernel_reads(self.stacks[p]) for p in PROJ)

    def _grouped(self, x: torch.Tensor, pairs: np.ndarray, experts: np.ndarray, bounds: np.ndarray,
                 wflat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, d) plus the GPU experts' weighted outputs over their pairs: pairs (P,) positions t * k + slot sorted
        by expert, experts (P,) theirs, bounds where the expert changes (moe_prefill.grouped_ffn: three launches)."""
        starts = np.array([0, *bounds, len(pairs)], np.int64)  # (G + 1,) each expert's pairs
        ids = self.lut_np[experts[starts[:-1]]]  # (G,) their places in the stacks
        return moe_prefill.grouped_ffn(self, x, [self.stacks[p] for p in PROJ], ids, starts, pairs, wflat, y)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        g, u, dn, gate = self.shared
        s = linear(ffn_values(self.cfg, linear(x, u), linear(x, g)), dn)  # (T, d)
        return torch.sigmoid(linear(x, gate)) * s  # gate (T, 1)

    def _to_host(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor):
        """x (T, d) float32, weights (T, k) float32, ids (T, k) int64 as numpy, after the device's one wait."""
        if x.device.type != "cuda":
            return x.float().numpy(), w.float().numpy(), idx.numpy()
        host = [t.to("cpu", non_blocking=True) for t in (x.float(), w.float(), idx)]  # pinned by torch's copy engine
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the wait for the routing (the shared expert keeps the GPU busy meanwhile)
        return tuple(t.numpy() for t in host)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.d_model)  # (T, d)
        T, k = x2.shape[0], self.cfg.n_experts_used
        w, idx = route(self.cfg, linear(x2, self.router))  # (T, k) each, on the device
        y = self._shared(x2) if self.shared is not None else torch.zeros_like(x2)  # (T, d) enqueued first
        xh, wh, ih = self._to_host(x2, w, idx)
        on_gpu = self.gpu[ih]  # (T, k)
        if T == 1:
            self.counts += (1, k, on_gpu.sum(), k - on_gpu.sum())
            np.add.at(self.expert_counts, ih[0], 1)
        cold = ~on_gpu
        offload = cold.any() and moe_prefill.offloads(self, T)  # a long prefill: the cold experts' rows to the device
        fetched = moe_prefill.fetch(self, ih, cold, x2.device) if offload else None  # crossing while the GPU computes
        # the GPU's experts, each over its tokens (asynchronous launches on CUDA)
        if on_gpu.any():
            pairs = np.flatnonzero(on_gpu)  # (P_g,) positions t * k + slot
            order = np.argsort(ih.ravel()[pairs], kind="stable")
            pairs = pairs[order]  # grouped per expert
            experts = ih.ravel()[pairs]
            bounds = np.flatnonzero(np.diff(experts)) + 1
            wflat = w.reshape(-1)  # (T k,) on the device
            if T == 1:
                for s in pairs:  # a decode step: x itself, the weight read on the device
                    y = y + wflat[s] * self._expert(int(ih[0, s]), x2)
            elif self._grouped_applies(x2):  # all the pairs in three launches
                y = self._grouped(x2, pairs, experts, bounds, wflat, y)
            else:
                pd = torch.from_numpy(pairs).to(x2.device)  # (P_g,)
                for a, b in zip([0, *bounds], [*bounds, len(pairs)]):
                    rows = pd[a:b] // k  # (m,) tokens of this expert
                    ye = self._expert(int(experts[a]), x2.index_select(0, rows)) * wflat[pd[a:b], None]  # (m, d)
                    y = y.index_add(0, rows, ye.to(y.dtype))
        # the CPU's experts: the Numba kernel, while the device computes the above
        if offload:
            y = y + moe_prefill.cold_on_device(self, x2, ih, w, cold, fetched)
        elif cold.any() and self.down_t is not None:  # each token's firing neurons only, prefill too
            # token by token: a token's firing neurons are ~a third of a dense expert's multiply-adds even where a
            # batch would reuse rows from the cache, and the file's down pages of cold experts are never read
            yc = np.zeros((T, self.d_model), np.float32)
            for t in np.flatnonzero(cold.any(1)):
                fired = self._sparse(NO_FLAGS, NO_FLAGS, -1, xh[t], np.ascontiguousarray(ih[t]),
                                     np.ascontiguousarray(wh[t]), yc[t])
                self.cold_active += fired if T == 1 else 0  # decode's count, as counts
            y = y + torch.from_numpy(yc).to(y.device, y.dtype)
        elif cold.any():
            t, s = np.nonzero(cold)  # (P_c,) each
            g, u, dn = self.cold
            yc = experts_ffn(xh, t, self.cold_map[ih[t, s]], wh[t, s], g, u, dn, self.activation,
                             fmts=self.cold_fmts[1:])  # (T, d)
            y = y + torch.from_numpy(yc).to(y.device, y.dtype)
        return y.reshape(shape)

    # -- decode steps as graphs (runtime/graph_steps.py, as HybridFFN's) ---------------------------------------------
    # pre: the router on the device, x and the routed ids and weights written to the host (to_host); hot: the routed
    # GPU experts from device-side ids (device_part: static shapes, so it is captured); the CPU: the routed cold
    # experts into the pinned sum (cold_rows), which the next layer's graph reads (cold_sum).
    def host_io(self, device: torch.device) -> MoEHostIO:
        if self.io is None:
            k = self.cfg.n_experts_used
            self.io = MoEHostIO.make(self.d_model, k, device)
            self.fired = torch.zeros(self.cfg.n_experts, dtype=torch.int32, device=device)
            self.route_w = torch.zeros(k, dtype=self.dtype, device=device)  # (k,) the token's routing weights
            self.route_ids = torch.zeros(k, dtype=torch.long, device=device)  # (k,) its experts
            self.route_local = torch.zeros(k, dtype=torch.long, device=device)  # (k,) stack index, 0 for a cold slot
            self.route_wgpu = torch.zeros(k, dtype=self.dtype, device=device)  # (k,) route_w, 0 for a cold slot
            if self.down_t is not None:  # the CPU's part over the firing neurons (cold_rows)
                self._sparse_setup()
            elif self.cold is not None:  # block rows: the CPU's part in one Numba call (experts_layer_q)
                fmts = (row_format(self.cold[1], self.d_model, self.cold_fmts[1]),
                        row_format(self.cold[2], self.n_ff, self.cold_fmts[2]))
                if all(f in CODE for f in fmts):
                    self._layer_args = (np.where(self.gpu, -1, self.cold_map),  # (E,) cold row index, -1: on device
                                        np.empty((k, self.n_ff), np.float32), ACT_CODE[self.activation],
                                        *(CODE[f] for f in fmts))
        return self.io

    def to_host(self, x: torch.Tensor, predict_op: Any = None, pred_x: torch.Tensor | None = None) -> None:
        """x (1, d): route it on the device; x, the experts and their weights into the host buffers, the routed GPU
        experts' stack indices and weights for device_part, the expert counts: one Triton kernel after the router's
        GEMV on CUDA (kernels/route.py), its torch twin elsewhere."""
        from hotneurons.kernels import route as routing

        io, cfg = self.io, self.cfg
        kernel = qlinear._on_kernels(x) and routing.fits(cfg.n_experts, cfg.n_experts_used, x.dtype)
        step = routing.route_step if kernel else routing.route_step_torch
        step(linear(x, self.router), x, cfg.n_experts_used, cfg.norm_topk, self.lut, self.fired, self.route_w,
             self.route_ids, self.route_local, self.route_wgpu, io.x_dev, io.ids_dev, io.w_dev)  # logits (1, E)

    def device_part(self, x: torch.Tensor) -> torch.Tensor:
        """(1, d) in x's dtype: the shared expert plus the token's routed GPU experts, read from their stacks by the
        device-side ids (qlinear.linear_rows: in place on the GEMV's kernels); a cold slot computes stack expert 0 at
        weight 0 (static shapes)."""
        y = self._shared(x) if self.shared is not None else torch.zeros_like(x)
        if not len(self.gpu_ids):
            return y
        k, st = self.cfg.n_experts_used, self.stacks
        local, w = self.route_local, self.route_wgpu  # (k,) each, written by to_host
        h = ffn_values(self.cfg, linear_rows(x, st["up"], local, self.n_ff),
                       linear_rows(x, st["gate"], local, self.n_ff)).reshape(k, self.n_ff)  # (k, n)
        ys = linear_rows(h, st["down"], local, self.d_model, per_slot=True).reshape(k, self.d_model)  # (k, d)
        return y + (w.to(ys.dtype)[None, :] @ ys).to(y.dtype)  # (1, d)

    def cold_rows(self, x: torch.Tensor, flags: Any = None, i: int = -1) -> None:
        """The CPU's part once the routing is in the host buffers: the token's cold experts' weighted sum into
        io.out. `flags`, `i`: wait for the graph's ready[i] first, release flag i after (prelaunched graphs)."""
        io, k = self.io, self.cfg.n_experts_used
        ready, release, layer = (flags.ready, flags.host, i) if flags is not None else (NO_FLAGS, NO_FLAGS, -1)
        if self.down_t is not None:  # the firing neurons only: wait, both passes and the release in one call
            k_act = self._sparse(ready, release, layer, io.x_np, io.ids, io.w, io.out[0])
            if k_act < 0:
                raise RuntimeError(f"layer {self.layer}: the GPU did not signal the routing (a failed graph?)")
            self.cold_active += k_act
        elif self._layer_args is not None:  # wait, both passes and the release in one call: no Python between them
            cold_of, H, act, fgu, fdn = self._layer_args
            g, u, dn = self.cold
            if experts_layer_q(ready, release, layer, io.x_np.reshape(1, -1), io.ids, io.w, cold_of,
                               g if act >= FIRST_GATED else u, u, dn, H, io.out, act, fgu, fdn,
                               cold_q.XQ_EXPERTS) < 0:  # read at the call: tests choose the route
                raise RuntimeError(f"layer {self.layer}: the GPU did not signal the routing (a failed graph?)")
        else:  # float rows
            if flags is not None and not wait_ready(ready, i, SPINS):
                raise RuntimeError(f"layer {self.layer}: the GPU did not signal the routing (a failed graph?)")
            cold = ~self.gpu[io.ids]  # (k,)
            if cold.any():
                g, u, dn = self.cold
                experts_ffn(io.x_np[None], np.zeros(int(cold.sum()), np.int64), self.cold_map[io.ids[cold]],
                            io.w[cold], g, u, dn, self.activation, out=io.out, fmts=self.cold_fmts[1:])
            else:
                io.out[:] = 0.0
            if flags is not None:
                flags.release(i)
        n_cold = int((~self.gpu[io.ids]).sum())  # the bookkeeping after the release: off the GPU's path
        self.counts += (1, k, k - n_cold, n_cold)
        np.add.at(self.expert_counts, io.ids, 1)

    def _sparse_setup(self) -> None:
        """sparse_layer's row maps, scratch and format codes, once (host_io, or the first decode token)."""
        if self._sparse_args is None:
            k, act = self.cfg.n_experts_used, ACT_CODE[self.activation]
            fgu, fdn = (CODE.get(row_format(a, self.d_model, f), -1)  # -1: floats
                        for a, f in ((self.cold[1], self.cold_fmts[1]), (self.down_t, None)))
            self._sparse_args = (np.where(self.gpu, -1, self.cold_map),  # (E,) gate / up row block, -1: on device
                                 *scratch(k, self.n_ff),  # a slot per routed neuron: (k n,) int64, float32; counts
                                 np.empty((numba.get_num_threads(), self.d_model), np.float32), act, fgu, fdn)

    def _sparse(self, ready: np.ndarray, release: np.ndarray, i: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                out: np.ndarray) -> int:
        """kernels/cold_experts_sparse.sparse_layer for one token: x (d,), ids / w (k,), out (d,) float32; returns the
        firing cold neurons' count, or -1 when ready[i] never came."""
        self._sparse_setup()
        cold_of, idx, hs, cnt, part, act, fgu, fdn = self._sparse_args
        g, u, _ = self.cold
        if (p := self.expert_predictors) is not None:  # the marked neurons of the experts with predictors only
            return sparse_layer_predicted(ready, release, i, x, ids, w, cold_of, self.dt_of, g, u, self.down_t, idx,
                                          hs, cnt, part, out, act, fgu, fdn, p.a, p.b, p.t, p.pid_of, p.z,
                                          cold_q.XQ_EXPERTS)
        return sparse_layer(ready, release, i, x, ids, w, cold_of, self.dt_of, g if act >= FIRST_GATED else u, u,
                            self.down_t, idx, hs, cnt, part, out, act, fgu, fdn, cold_q.XQ_EXPERTS)

    def cold_sum(self) -> torch.Tensor:
        """(d,) float32 on the device: the CPU's cold experts' sum for the token (read over PCIe on CUDA)."""
        return self.io.out_dev[0]
