"""pi-profile on CUDA: the same counts as on the CPU (skipped without a GPU)."""

import numpy as np
import pytest
import torch
from hotneurons.artifacts.profile import read_profile
from hotneurons.profiler.profile import ProfileConfig, profile_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["opt", "llama-reglu", "llama-swiglu"])
def test_cuda_counts_equal_cpu_counts(name, tiny_model_dir, text_corpus, tmp_path):
    cfg = ProfileConfig(model=str(tiny_model_dir(name)), dataset=str(text_corpus), tokens=2000, seq_len=64,
                        batch_size=4, samples_per_layer=300, calibration_tokens=256, dtype="float32")
    gpu = profile_model(cfg, tmp_path / "gpu", device="cuda", progress=False)
    cpu = profile_model(cfg, tmp_path / "cpu", device="cpu", progress=False)
    assert gpu["device"].startswith("cuda") and cpu["device"] == "cpu"
    a = read_profile(tmp_path / "gpu")[0]["count"].to_numpy()
    b = read_profile(tmp_path / "cpu")[0]["count"].to_numpy()
    # float32 kernels differ between devices: a value within rounding of 0 (or of tau) may flip
    assert np.abs(a - b).sum() <= 0.002 * b.sum() + 5
    if gpu["taus"] is not None:
        np.testing.assert_allclose(gpu["taus"], cpu["taus"], rtol=1e-3)
    for f in ("layer_001.x.npy", "layer_001.mask.npy"):
        x = np.load(tmp_path / "gpu/profile/samples" / f)
        assert x.shape[0] == 300


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_count_kernel_matches_float64_reference(dtype):
    from hotneurons.profiler.hooks import as_tau, count_active

    gen = torch.Generator().manual_seed(3)
    for tokens, n in [(1, 1), (7, 13), (513, 1000), (4096, 2048)]:
        h = torch.randn(tokens, n, generator=gen, dtype=torch.float64)
        h[torch.rand(tokens, n, generator=gen) < 0.5] = 0.0
        h = h.to(dtype)
        for tau in (None, 0.3):
            ref = (h.double().abs() > as_tau(tau)).sum(0)  # taus are float32 values
            got = count_active(h.cuda(), tau).cpu()
            assert torch.equal(got.long(), ref), (tokens, n, tau)
