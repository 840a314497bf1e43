"""pi-profile's real output through solve_placement: the memory accounting closes on real models."""

import pandas as pd
import pytest
from hotneurons.artifacts.profile import read_profile
from hotneurons.common.hardware import get_hardware
from hotneurons.common.units import parse_bytes
from hotneurons.solver import SolverError, solve_placement

profiler = pytest.importorskip("hotneurons.profiler.profile")


@pytest.mark.parametrize("family", ["opt", "llama-reglu"])
def test_profile_then_solve(family, tiny_model_dir, text_corpus, tmp_path):
    cfg = profiler.ProfileConfig(model=str(tiny_model_dir(family)), dataset=str(text_corpus), tokens=300,
                                 seq_len=48, batch_size=3, samples_per_layer=0, dtype="float32")
    profiler.profile_model(cfg, tmp_path, progress=False)
    _, meta = read_profile(tmp_path)
    p = meta["model"]["params"]
    with pytest.raises(SolverError, match="minimum") as e:
        solve_placement(tmp_path, get_hardware("rtx4090"), vram_bytes=1000, dtype="fp32", ctx=8, reserve_bytes=0)
    least = str(e.value).split("at least ")[1].split()[0]
    s = solve_placement(tmp_path, get_hardware("rtx4090"), vram_bytes=parse_bytes(least), dtype="fp32", ctx=8,
                        reserve_bytes=0)
    s = solve_placement(tmp_path, get_hardware("rtx4090"), vram_bytes=s["budget"]["fixed_gpu_bytes"] + 10**5,
                        dtype="fp32", ctx=8, reserve_bytes=0, objective="activations")
    g = s["memory"]["gpu"]
    weights = (g["attention"] + g["ffn_fixed"] + g["final_norm_and_other"] + g["embedding"] + g["lm_head"]
               + g["ffn_neurons"] + s["memory"]["cpu"]["ffn_neurons"] + s["memory"]["cpu"].get("embedding", 0))
    assert weights == 4 * p["total"]  # every parameter accounted once, in fp32
    # an untied input embedding is in CPU RAM (the runtime reads one row a token), a tied one on the GPU
    assert (g["embedding"], s["memory"]["cpu"].get("embedding", 0)) == (
        (0, 4 * p["embedding"]) if p["lm_head"] else (4 * p["embedding"], 0))
    assert s["memory"]["rows_per_neuron"] == (3 if meta["model"]["gated"] else 2)
    df = pd.read_parquet(tmp_path / "placement" / "placement.parquet")
    assert len(df) == meta["model"]["n_layers"] * meta["model"]["n_neurons"] and df["gpu"].any()


def table_bytes(rt) -> int:
    """Bytes of the decoder's per-position tables (RoPE's cos and sin, the cache's slot numbers): the workspace the
    solver leaves uncounted."""
    d = rt.lm.decoder
    return sum(t.nbytes for k in ("cos", "sin", "cos_local", "sin_local", "slots")
               if (t := getattr(d, k, None)) is not None)


@pytest.mark.parametrize("family", ["opt", "llama-reglu"])  # tied, untied embedding
def test_runtime_fits_the_budget_the_solver_filled(family, tiny_model_dir, text_corpus, tmp_path):
    """pi-generate at pi-solve's --vram holds what the solver placed: every byte the runtime puts on the device (its
    weights, predictors, neuron ids, static KV cache) is counted by the solver."""
    import numpy as np
    import tiny
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_runtime

    cfg = profiler.ProfileConfig(model=str(tiny_model_dir(family)), dataset=str(text_corpus), tokens=300,
                                 seq_len=48, batch_size=3, samples_per_layer=0, dtype="float32")
    profiler.profile_model(cfg, tmp_path, progress=False)
    _, meta = read_profile(tmp_path)
    info = meta["model"]
    tiny.write_predictors(tmp_path, info, 0.0)
    hw = get_hardware("rtx4090")
    least = solve_placement(tmp_path, hw, vram_bytes=10**9, dtype="fp32", ctx=16, reserve_bytes=0,
                            write=False)["budget"]["fixed_gpu_bytes"]
    rows = 3 if info["gated"] else 2
    for extra in np.random.default_rng(0).integers(0, 4 * info["n_neurons"] * rows * info["d_model"], 3):
        vram = int(least + extra)
        s = solve_placement(tmp_path, hw, vram_bytes=vram, dtype="fp32", ctx=16, reserve_bytes=0)
        rt = load_runtime(tmp_path, RuntimeConfig(device="cpu", dtype="float32", vram=vram),
                          trust_remote_code=False)
        g = s["memory"]["gpu"]
        assert g["total"] <= vram
        # the workspace: buffers the runtime makes as it runs; RoPE's frequency tables (bytes) are the only
        # buffers the solver leaves to it
        rope = table_bytes(rt)
        assert rt.bytes_gpu <= g["total"] - g["workspace"] + rope
        if family == "llama-reglu":  # the static KV cache of the solver's --ctx counts
            assert rt.lm.decoder.ctx == 16
