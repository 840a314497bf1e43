"""The string kinds that cross stage boundaries, as enums, and the one place a string is checked against them.

Every enum here is a `str` subclass: its members compare equal to (and hash like) their values, json writes them
as their values, and f-strings print the value. So artifacts on disk hold plain strings, and code that still
compares against a literal keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, TypeVar

K = TypeVar("K", bound="Kind")


class Kind(str, Enum):
    """Base of the string enums: prints and formats as its value (str, Enum would print `Kind.NAME`)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class FixableError(Exception):
    """A one-line error whose fix is another value for some parameters. `params` names them as the library's
    arguments (`vram_bytes`, `force`); the message does not name CLI flags, the CLIs add theirs (common/cli.py)."""

    def __init__(self, message: str, *, params: str | tuple[str, ...] = ()):
        super().__init__(message)
        self.params = (params,) if isinstance(params, str) else tuple(params)


def known(allowed: Any) -> list[str]:
    """The names `choose` accepts from `allowed` (an enum class, a mapping's keys, or an iterable of strings)."""
    if isinstance(allowed, type) and issubclass(allowed, Enum):
        return [str(m.value) for m in allowed]
    if isinstance(allowed, Mapping):
        return [str(k) for k in allowed]
    return [str(v) for v in allowed]


def choose(value: Any, allowed: type[K] | Mapping[str, Any] | Iterable[str], what: str,
           error: type[Exception] = ValueError, param: str | None = None) -> Any:
    """`value` if it is one of `allowed`, else a one-line `error`: "unknown {what} 'x': choose one of a, b, c".

    For an enum class the member is returned (`choose("relu", Activation, "activation") is Activation.RELU`);
    otherwise the value itself. `what` names the thing, not a CLI flag; `param` (the library argument it came
    from) is set as the error's `params`, from which a CLI names its flag.
    """
    enum = isinstance(allowed, type) and issubclass(allowed, Enum)
    if enum:
        try:
            return allowed(value)
        except ValueError:
            pass
    names = known(allowed)  # after the enum's own lookup: a model's load calls this per tensor
    if not enum and value in names:
        return value
    e = error(f"unknown {what} {str(value)!r}: choose one of {', '.join(names)}")
    if param:
        e.params = (param,)
    raise e


class Activation(Kind):
    """How an FFN turns its up projection into per-neuron values (see models/family.py)."""

    RELU = "relu"  # ungated ReLU (OPT, Falcon-ReLU)
    GELU = "gelu"  # ungated GELU or SiLU: no exact zeros
    REGLU = "reglu"  # relu(gate) * up (ReluLLaMA, ProSparse)
    DRELU = "drelu"  # relu(gate) * relu(up) (Bamboo, TurboSparse)
    FATRELU = "fatrelu"  # gate where gate > t, times up (ProSparse's FATReLU)
    SWIGLU = "swiglu"  # silu(gate) * up (original LLaMA, SmolLM2)
    GEGLU = "geglu"  # gelu(gate) * up (Gemma)

    @property
    def relu_family(self) -> bool:
        """Exact zeros: a neuron whose value is 0 contributes nothing, so skipping it is lossless."""
        return self in RELU_KINDS


RELU_KINDS = frozenset({Activation.RELU, Activation.REGLU, Activation.DRELU, Activation.FATRELU})


class Rule(Kind):
    """When a neuron counts as active (the profile's `rule`, applied again by every later stage)."""

    NONZERO = "nonzero"  # ReLU family: its value is not 0
    ABS_TAU = "abs>tau"  # others: |value| exceeds the layer's calibrated threshold tau_l
    # gated models profiled with `pi-profile --criterion gate` / `gate-h` (common/gating.py): the gate decides
    GATE_TAU = "gate>tau"  # |act(gate x)| > taus[l] (CATS)
    GATE_H_TAU = "gate>tau,abs>tau"  # |act(gate x)| > gate_taus[l] and |value| > taus[l]

    @classmethod
    def for_activation(cls, activation: str) -> Rule:
        return cls.NONZERO if choose(activation, Activation, "activation").relu_family else cls.ABS_TAU


class RuntimeMode(Kind):
    """How pi-generate and pi-serve run the FFNs (runtime/)."""

    HYBRID = "hybrid"  # hot neurons on the device, the active cold ones on the CPU
    DENSE = "dense"  # the same layout, every neuron computed
    LAYER_SPLIT = "layer-split"  # whole layers on the device up to the budget, the rest on the CPU (llama.cpp's -ngl)


class MaskSource(Kind):
    """Which cold neurons a hybrid FFN computes for a token (runtime/hybrid_ffn.py)."""

    DENSE = "dense"  # all of them
    ORACLE = "oracle"  # those that fire, from the true activations (checks, not speed)
    PREDICTOR = "predictor"  # those the layer's predictor marks
    GATE = "gate"  # gated models, no predictor: those whose gate (and |h|) pass the layer's thresholds
    # (common/gating.py), the cold ones tested gate-first by the CPU kernel itself


class GpuOps(Kind):
    """What computes a decode step's small GPU ops and one token's GEMVs (kernels/ops.Ops.named)."""

    TORCH = "torch"  # torch's kernels: the reference, and what the CPU runs
    COMPILE = "compile"  # the small ops through torch.compile
    TRITON = "triton"  # the hand-written kernels of kernels/fused.py


class PredictorDtype(Kind):
    """How the predictors are stored on the device (pi-solve / pi-generate / pi-serve --predictor-dtype)."""

    AUTO = "auto"  # as trained (fp16 / the compute dtype); pi-generate: what the placement counted
    Q8_0 = "q8_0"  # llama.cpp's blocks of 32, made at load: 17/32 of fp16's bytes


class BatchStep(Kind):
    """How several sequences decode a token each (runtime/batch.py, pi-serve --parallel)."""

    AUTO = "auto"  # interleaved where the runtime replays CUDA graphs, batched elsewhere
    BATCHED = "batched"  # one eager step for all: shared weight reads, the cold rows' union read once
    INTERLEAVED = "interleaved"  # the batch-1 step (its graphs) for each sequence in turn
