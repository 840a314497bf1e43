"""Every spelling of a float format that weights/formats.py reads (f16, fp16, float16, ...) is read wherever a dtype is
taken: the compute dtype (pick_dtype), pi-export --dtype, and a model's recorded weight_dtype in pi-solve."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from hotneurons.common.model_source import ModelError
from hotneurons.export.cli import main as export_main
from hotneurons.models.family import pick_dtype
from hotneurons.solver.cost import DTYPE_BYTES, model_dtype

SPELLINGS = {torch.float32: ("f32", "fp32", "float32", "F32"), torch.float16: ("f16", "fp16", "float16", "FP16"),
             torch.bfloat16: ("bf16", "bfloat16"), torch.float64: ("f64", "fp64", "float64")}


@pytest.mark.parametrize("want", list(SPELLINGS))
def test_pick_dtype_reads_every_spelling(want):
    for name in SPELLINGS[want]:
        assert pick_dtype(name, "cpu") is want, name
    assert pick_dtype("auto", "cpu") is torch.float32 and pick_dtype("auto", "cuda:1") is torch.float16


@pytest.mark.parametrize("bad", ["q4_0", "half", "int8", ""])
def test_pick_dtype_refuses_with_the_spellings(bad):
    with pytest.raises(ModelError) as e:
        pick_dtype(bad, "cpu")
    msg = str(e.value)
    assert "\n" not in msg and f"unknown dtype {bad!r}" in msg and e.value.params == ("dtype",)
    assert all(n in msg for n in ("auto", "f16", "fp16", "float16", "bf16", "f32"))


def test_model_dtype_reads_every_spelling_and_keeps_the_written_names():
    # pi-solve's names as placement meta.json files have them (fp16, fp32), whatever spelling the model records
    for names, want in ((SPELLINGS[torch.float16], "fp16"), (SPELLINGS[torch.float32], "fp32"),
                        (SPELLINGS[torch.bfloat16], "bf16")):
        for name in names:
            assert model_dtype(name) == want, name
            assert want in DTYPE_BYTES
    for other in (None, "float64", "q4_0", "nonsense"):  # no float format torch computes with: fp16, as before
        assert model_dtype(other) == "fp16"


@pytest.mark.parametrize("name", ["f32", "F16", "bf16", "fp32", "fp16", "float32", "float16", "bfloat16", "fp64",
                                  "float64", "q4_0"])
def test_export_dtype_choices(name, tmp_path):
    # the option parses (then the run folder's absence stops it) for the float formats torch computes with, under the
    # table's names and every alias of theirs; float64 and block formats are refused as before
    r = CliRunner().invoke(export_main, ["--run", str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--dtype",
                                         name])
    refused = "Invalid value for '--dtype'" in r.output
    assert refused == (name in ("fp64", "float64", "q4_0")), (name, r.output)
    assert r.exit_code != 0 and (refused or "no profile in" in r.output), r.output
