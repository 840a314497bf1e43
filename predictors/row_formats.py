"""pi-eval --row-format: the FFN weights rounded the way the runtime stores them, so perplexity says what each storage
format costs without the runtime's kernels (bench/format_quality.py measures the same through the runtime).

The runtime keeps a neuron's gate row, up row and down column as rows of d_model weights (runtime/cold_rows.py): bf16,
or llama.cpp's q8_0 / q4_0 / q4_1 blocks of 32 weights along d_model. Here every neuron's three rows are stored that
way (models/ffn_weights.as_stored: the runtime's own conversions, so a GGUF file's rows already in the format are
kept byte for byte and its down projection is re-quantized along neurons) and widened back to the evaluation's dtype.
What this leaves out: the runtime's hot down columns are blocked along hot neurons instead (qlinear), and the
runtime's own arithmetic. Attention, norms, embeddings, head and biases stay as the model runs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from hotneurons.common.kinds import FixableError, choose
from hotneurons.weights.formats import WeightFormat, spec

if TYPE_CHECKING:  # torch and the models load in stored_as: pi-eval checks the names before they load
    from hotneurons.models.family import LoadedModel
    from hotneurons.models.streamed import StreamedModel

ROW_FORMATS = (WeightFormat.BF16, WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1)


class RowFormatError(FixableError, ValueError):
    """A row format that is unknown or does not fit the model's rows; `params` = ("row_formats",)."""


def parse_row_formats(names: Iterable[str] | None) -> list[WeightFormat]:
    """The formats asked for, in order and once each; every name may be a comma list ("q8_0,q4_0"). An unknown name
    is refused in one line naming it and the choices."""
    out: list[WeightFormat] = []
    for name in names or ():
        for part in str(name).split(","):
            fmt = WeightFormat(choose(part.strip().lower(), [f.value for f in ROW_FORMATS], "row format",
                                      RowFormatError, param="row_formats"))
            if fmt not in out:
                out.append(fmt)
    return out


def check_rows(formats: Iterable[WeightFormat], d_model: int) -> None:
    """Refuse, before any pass runs, a block format whose blocks do not tile a row of d_model weights."""
    for fmt in formats:
        block = spec(fmt).block
        if d_model % block:
            raise RowFormatError(f"row format {fmt} stores blocks of {block} weights, and this model's rows of "
                                 f"{d_model} (d_model) are not a whole number of them: leave {fmt} out",
                                 params="row_formats")


@contextmanager
def stored_as(lm: LoadedModel | StreamedModel, fmt: WeightFormat) -> Iterator[None]:
    """While the block runs, `lm`'s FFNs compute with their rows stored in `fmt` (see the module's docstring).

    Layer by layer the rows are rounded as each layer is read (StreamedModel.row_format). A transformers model has its
    FFN weights overwritten in place and put back after; the originals wait in CPU memory, so that the device holds no
    second copy of the FFNs."""
    import torch
    from hotneurons.models.ffn_weights import FFNWeights, as_stored
    from hotneurons.models.streamed import StreamedModel

    if isinstance(lm, StreamedModel):
        lm.row_format = fmt
        try:
            yield
        finally:
            lm.row_format = None
        return
    saved = []  # (parameter, its original values on the CPU)
    try:
        with torch.no_grad():
            for layer in lm.layers:
                lin = lm.adapter.layer_ffn(layer)  # {"up", "down", "gate"?}: nn.Linear
                up = lin["up"].weight
                w = FFNWeights(up=up.detach(), down=lin["down"].weight.detach(),
                               gate=lin["gate"].weight.detach() if "gate" in lin else None)
                r = as_stored(w, fmt, up.device, up.dtype)
                for name, new in (("up", r.up), ("gate", r.gate), ("down", r.down_t.T)):  # down (d, n) = down_t.T
                    if new is not None:
                        p = lin[name].weight
                        saved.append((p, p.detach().to("cpu", copy=True)))
                        p.copy_(new)
        yield
    finally:
        with torch.no_grad():
            for p, old in saved:
                p.copy_(old)
