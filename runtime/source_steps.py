"""`SourceSteps`: the decode steps of our own decoders (hotneurons.models, loaded by runtime/engine.py) for the runner
of runtime/graph_steps.py, which replays them as CUDA graphs with the CPU's cold rows between them.

A step's buffers are static: the token and its position are device tensors the graphs read (an untied embedding's
row is looked up on the host, where that table lives, into a pinned buffer that layer 0's graph copies in), and the
decoder's own KV cache is the static cache: attention reads all of it under a mask of the filled slots. Prefill runs
eagerly through the decoder (engine.forward) and fills the same cache, so nothing is copied between them.
"""

from __future__ import annotations

import torch
from hotneurons.models.common import embed_rows
from hotneurons.runtime.graph_steps import GraphSteps
from hotneurons.runtime.hybrid_ffn import HybridFFN
from hotneurons.weights.qtensor import QTensor


def _on(w, device: torch.device) -> bool:
    """Whether a weight (float tensor or QTensor) lives on `device`."""
    where = w.data.device if isinstance(w, QTensor) else w.device
    return where.type == device.type


class SourceSteps(GraphSteps):
    def __init__(self, decoder, ffns: list[HybridFFN], device: torch.device, dtype: torch.dtype, graphs: bool,
                 ops: str = "torch", prelaunch: bool = True):
        super().__init__(ffns, device, graphs, decoder.ctx, ops, prelaunch)
        self.m, self.dtype = decoder, dtype
        d, L = ffns[0].d_model, len(ffns)
        self.tok = torch.zeros(1, dtype=torch.long, device=device)  # (1,) the step's token
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # () its position
        emb = decoder.tok_embd
        self.emb_row = (None if _on(emb, device) else  # (1, d_embed) the token's row, looked up on the host
                        torch.zeros((1, emb.shape[1]), dtype=dtype, pin_memory=device.type == "cuda"))
        self.h2 = [torch.zeros((1, d), device=device, dtype=dtype) for _ in range(L)]  # (1, d) residual after attn
        self.x = [torch.zeros((1, d), device=device, dtype=dtype) for _ in range(L)]  # (1, d) FFN inputs
        self.hot_sum = [torch.zeros((1, d), device=device, dtype=dtype) for _ in range(L)]  # (1, d) hot FFN sums
        # the family's fused form of a layer (a handful of kernels, not dozens), where it has one for this model
        self.fused = decoder.step_supported() is None
        self.pos1 = self.pos.view(1)  # (1,) the position as the fused ops read it

    def set_input(self, token: int, position: int) -> None:
        if self.emb_row is None:
            self.tok.fill_(token)
        else:  # free to overwrite: each step waits for every layer's `pre`, so layer 0's copy of it is done
            self.emb_row.copy_(embed_rows(self.m.tok_embd, torch.tensor([token]), self.dtype))
        self.pos.fill_(position)
        self.m.wrote(position + 1)  # the graphs write this position's keys and values where Python does not see

    def cache_tensors(self) -> list[torch.Tensor]:
        # none: warm-up and capture write the step's own slot of the KV cache, which the step itself writes again
        # before any layer reads it
        return []

    def _pos0(self) -> int | torch.Tensor:
        """The position as the decoder takes it: an int eagerly (attention reads the filled slots only), else the
        device tensor the graphs read."""
        return self.pos if self._filled is None else self._filled - 1

    def _output(self, i: int) -> torch.Tensor:
        """(1, d) layer i's output: its residual after attention plus its FFN's, the CPU's cold sum read in place."""
        f, y = self.ffns[i], self.hot_sum[i]
        if f.n_cold:
            y = y + f.cold_sum().to(y.dtype)
        return self.m.after_ffn(i, self.h2[i], y)

    def pre(self, i: int) -> None:
        if self.fused:
            self._fused_pre(i)
            return
        if i == 0:
            rows = None if self.emb_row is None else self.emb_row.to(self.device, non_blocking=True)  # a copy node
            h = self.m.embed(self.tok, self._pos0(), rows)  # (1, d)
        else:
            h = self._output(i - 1)
        h2, x = self.m.attention(i, h, self._pos0())  # (1, d) each
        self.h2[i].copy_(h2)
        self.x[i].copy_(x)
        f = self.ffns[i]  # a powerinfer-form predictor reads h2[i], the pre-FFN norm's input
        f.to_host(self.x[i], self.ops.predict, self.h2[i] if f.prenorm else None)

    def _fused_pre(self, i: int) -> None:
        """pre through the decoder's step_layer: the previous layer's sums are added inside its first kernel."""
        if i == 0:
            self.m.step_begin(self.pos1)
            rows = None if self.emb_row is None else self.emb_row.to(self.device, non_blocking=True)  # a copy node
            prev = self.m.embed(self.tok, self._pos0(), rows)  # (1, d)
        else:
            p = self.ffns[i - 1]
            prev = (self.h2[i - 1], self.hot_sum[i - 1], p.cold_sum() if p.n_cold else None)
        self.m.step_layer(i, prev, self.pos1, self.ops, self.h2[i], self.x[i], self._filled)
        f = self.ffns[i]
        f.to_host(self.x[i], self.ops.predict, self.h2[i] if f.prenorm else None)

    def _final(self) -> torch.Tensor:
        return self.m.logits(self._output(len(self.ffns) - 1))[0]  # (vocab,) float32
