"""Forward hooks on a model's FFNs: what the profiler and the predictors' evaluation observe and mask, without editing
any model code. FFNHooks hooks a transformers model (a LoadedModel, models/family.py); StageHooks also attaches to a
model run layer by layer (models/streamed.py), whose forward calls the same methods."""

from __future__ import annotations

import torch
from hotneurons.common.gate_masks import column_norms
from hotneurons.common.kinds import Activation
from hotneurons.models.family import LoadedModel


class FFNHooks:
    """Context manager: per decoder layer, forward pre-hooks on the FFN's up projection (input x) and down
    projection (activation values h). Subclasses implement `on_ffn(layer, h, x)`; a tensor returned replaces
    h (masking), None leaves it. x is captured only while `wants_x()` says so (it costs memory).

    Gated FFNs, for the sparsity criteria of common/gating.py (what `wants_gate()` / `wants_input()` say when the hooks
    are entered decides which hooks are registered): a forward hook on the gate projection hands act(gate x) to
    `on_gate(layer, a)` before the layer's on_ffn; a pre-hook on the FFN module hands its input x to
    `on_ffn_input(layer, x)`, whose returned tensor replaces the x that gate and up read (input channels masked).

    No model code is edited: the down projection's input is exactly the per-neuron values h, whatever the family.
    """

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self._x: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def wants_x(self) -> bool:
        return False

    def wants_gate(self) -> bool:
        return False

    def wants_input(self) -> bool:
        return False

    def on_ffn(self, layer: int, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def on_gate(self, layer: int, a: torch.Tensor) -> None:
        """act(gate x) (..., n) of a gated FFN (while wants_gate), before the layer's on_ffn."""

    def on_ffn_input(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The FFN input x (..., d_model) before gate and up (while wants_input); a tensor returned replaces it."""
        return None

    def __enter__(self):
        gate, inputs = self.wants_gate(), self.wants_input()
        for i, layer in enumerate(self.lm.layers):
            ffn = self.lm.adapter.layer_ffn(layer)
            if inputs:  # before up's pre-hook: x as captured is x as gate and up read it
                self._handles.append(_ffn_module(self.lm, layer).register_forward_pre_hook(self._in_hook(i)))
            self._handles.append(ffn["up"].register_forward_pre_hook(self._up_hook(i)))
            if gate:
                act = _gate_act(self.lm, layer)
                self._handles.append(ffn["gate"].register_forward_hook(
                    lambda _mod, _args, g, i=i, act=act: self.on_gate(i, act(g))))  # g: (..., n) gate x
            self._handles.append(ffn["down"].register_forward_pre_hook(self._down_hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._x.clear()

    def _in_hook(self, i: int):
        def hook(_mod, args):
            out = self.on_ffn_input(i, args[0])  # args[0]: (..., d_model)
            return None if out is None else (out, *args[1:])
        return hook

    def _up_hook(self, i: int):
        def hook(_mod, args):
            if self.wants_x():
                self._x[i] = args[0]  # (..., d_model)
        return hook

    def _down_hook(self, i: int):
        def hook(_mod, args):
            out = self.on_ffn(i, args[0], self._x.pop(i, None))  # args[0]: (..., n_neurons)
            return None if out is None else (out,)
        return hook


def _ffn_module(lm: LoadedModel, layer: torch.nn.Module) -> torch.nn.Module:
    mod = lm.adapter.ffn_module(layer) if lm.adapter.gated else None
    if mod is None:
        raise ValueError(f"the input sparsity criteria mask a gated FFN's input; {lm.info['name']} is not gated")
    return mod


def _gate_act(lm: LoadedModel, layer: torch.nn.Module):
    """The function the model applies to gate x (its FFN module's own `act_fn`, so act(g) is bit for bit the factor
    of h); only SwiGLU / GeGLU FFNs, whose h is act(g) * up."""
    mod = lm.adapter.ffn_module(layer) if lm.adapter.gated else None
    act = getattr(mod, "act_fn", None)
    if act is None or lm.activation not in (Activation.SWIGLU, Activation.GEGLU):
        raise ValueError(f"the gate sparsity criteria read act(gate x) of a SwiGLU or GeGLU FFN; {lm.info['name']} "
                         f"is {lm.activation}")
    return act


def device_of(lm) -> torch.device:
    """Where a LoadedModel or a StreamedModel computes."""
    return next(lm.model.parameters()).device if isinstance(lm, LoadedModel) else lm.device


def dtype_of(lm) -> torch.dtype:
    return next(lm.model.parameters()).dtype if isinstance(lm, LoadedModel) else lm.dtype


class StageHooks(FFNHooks):
    """FFNHooks for both ways a stage runs a model. On a LoadedModel (transformers): the FFN's forward hooks, and where
    `pre_norms` lists the layers' pre-FFN RMSNorms, a pre-hook on each that hands its input (the residual x_pre) to
    `on_pre_norm`. On a StreamedModel (models/streamed.py) nothing is registered: entered, the hooks attach to it,
    and its layer-by-layer forward calls on_pre_norm, on_ffn_input (while wants_input), on_gate (while wants_gate),
    on_ffn (x only while wants_x) and end_layer itself, in that order, as the transformers path's hooks fire."""

    pre_norms: list | None = None

    def __enter__(self):
        if not isinstance(self.lm, LoadedModel):
            self.lm.attach(self)
            return self
        super().__enter__()
        for i, norm in enumerate(self.pre_norms or ()):
            self._handles.append(norm.module.register_forward_pre_hook(
                lambda _mod, args, i=i: self.on_pre_norm(i, args[0])))  # (..., d_model) the pre-norm residual
        return self

    def __exit__(self, *exc) -> None:
        if not isinstance(self.lm, LoadedModel):
            self.lm.detach(self)
            return
        super().__exit__(*exc)

    def on_pre_norm(self, layer: int, x_pre: torch.Tensor) -> None:
        """The residual entering layer `layer`'s pre-FFN RMSNorm (..., d_model), before its on_ffn."""

    def end_layer(self, layer: int) -> None:
        """After layer `layer`'s FFN (the streamed path only)."""


def gate_column_norms(lm) -> list[torch.Tensor]:
    """Per layer (d,) ||W_gate[:, i]||_2 on the model's device: a LoadedModel's from its modules, a StreamedModel's
    read from its file."""
    if isinstance(lm, LoadedModel):
        return [column_norms(lm.adapter.layer_ffn(layer)["gate"].weight) for layer in lm.layers]
    return lm.gate_column_norms()
