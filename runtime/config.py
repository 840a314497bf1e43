"""`RuntimeConfig`: how pi-generate and pi-serve run a model, with its named presets; kept free of torch so that the
command lines' --help answers at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    """How to run. Named presets in PRESETS; CLI flags override single fields."""

    mode: str = "hybrid"
    oracle: bool = False  # hybrid: true masks computed densely instead of the predictors
    device: str = "auto"  # auto: cuda if available
    dtype: str = "auto"  # compute dtype on the device (auto: fp16 on CUDA, fp32 on CPU)
    # storage of the cold rows in CPU RAM (kernels/names.COLD_DTYPES): bf16, int8, q8_0, q4_0, q4_1 or a K-quant (kept
    # as a file stores it); auto: the file's format where the kernels read it (a GGUF's Q4_0/Q4_1/Q8_0 and
    # Q4_K/Q5_K/Q6_K rows byte for byte), else the nearest they read (engine.auto_format)
    cold_dtype: str = "auto"
    # the hot rows on the device (formats.GPU_DTYPES): a float dtype, q8_0, q4_0, q4_1 or a K-quant (qlinear's GEMVs);
    # auto: the file's format where the GPU kernels read it, floats in the compute dtype
    gpu_dtype: str = "auto"
    # the predictors on the device: "q8_0" (llama.cpp's blocks of 32, made at load: about half the bytes the GPU reads
    # a token, the same masks up to rounding; bench/predictor_quant.py) or "auto": what pi-solve --predictor-dtype
    # counted where the run has a placement, else as trained (the compute dtype)
    predictor_dtype: str = "auto"
    threads: int | None = None  # Numba threads for the cold neurons (None: kernels/cold.default_threads)
    vram: int | None = None  # bytes the device may hold (None: no check; layer-split: needed unless gpu_layers)
    gpu_layers: int | None = None  # layer-split: decoder layers kept on the device (None: as many as vram allows)
    cuda_graphs: bool = True  # CUDA: each FFN's per-token GPU work replayed as CUDA graphs (False: eager launches)
    static_decode: bool = True  # LLaMA family, hybrid/dense: decode steps by runtime/static_decoder.py
    # static decoder on CUDA, predictor or dense masks: the share of each token's marked cold neurons that the GPU
    # computes from the cold rows in page-locked host RAM, read over PCIe while the CPU reads the rest from DRAM
    # (None: measured at start; 0: off, the CPU reads every cold row)
    pcie_share: float | None = None
    # static decoder: tokens its KV cache holds, on the device and counted by --vram (None: the placement's pi-solve
    # --ctx when loaded from a run, else static_decoder.CAPACITY); longer generations decode through HF
    ctx: int | None = None
    # static decoder with CUDA graphs: what computes a step's GPU ops, the norms, RoPE, attention, the predictor and
    # one token's GEMVs (common/kinds.GpuOps): "triton" (kernels/fused.py, one kernel where torch runs several),
    # "torch", or "compile" (torch.compile on the small ops; a few seconds at the first step). auto: triton where it
    # imports (torch's CUDA builds bring it), else torch
    ops: str = "auto"
    # static decoder with CUDA graphs: launch layer i+1's graph before layer i's cold part, held on the GPU by a host
    # flag, where the driver can (False: each graph after the previous cold part, the fallback without the driver's
    # stream memory operations; kept selectable so that bench A/Bs can time the launches prelaunch hides)
    prelaunch: bool = True
    # a measured PCIe share on CUDA graphs: move it by timed balancing rounds in decode (False: keep the share
    # measured at start; for bench A/Bs of the rounds, which gain only where the start measurement is off)
    pcie_balance: bool = True
    # gated models (common/gating.py): the FFN sparsity whose profile thresholds mask 'gate' applies, hot and cold
    # neurons alike (None: the profile's target where the run has no predictors, else the predictors; 0: dense)
    sparsity: float | None = None
    criterion: str | None = None  # gate, h or gate-h (None: the one the profile counted)
    # after the balancing rounds, re-check the share every balance.RECHECK_TOKENS steps (False: keep the first
    # series' share for life; an A/B whose gain on the device is not yet shown, only on a simulated machine)
    pcie_recheck: bool = True
    # a ReLU-family mixture of experts: the cold experts compute only the neurons their expert predictors mark, where
    # the run has RUN/predictors/expert_predictors.safetensors (runtime/expert_predictors.py; False: every gate row)
    expert_predictors: bool = True
    # prompts of at most this many tokens go through the decode step a token at a time instead of one prefill pass
    # (None: runtime/generate.STEP_PREFILL_MOE for a mixture of experts that decodes by CUDA graphs, whose eager pass
    # costs a fixed ~0.2 s at any length on Qwen3-30B-A3B against ~9 ms a step; 0 elsewhere, where a dense hybrid's
    # steps take its predictors' masks and one pass computes the FFN dense)
    step_prefill: int | None = None


@dataclass(frozen=True)
class RuntimeRequest:
    """What pi-generate and pi-serve open (runtime/cli.open_runtime): a run directory or a model, or both, and how to
    run it. The command lines' flags make one (runtime/cli.runtime_request); runtime/load.load_runtime takes its
    fields."""

    cfg: RuntimeConfig = RuntimeConfig()
    run_dir: str | None = None  # profile/, placement/, predictors/ (pi-profile, pi-solve, pi-train-predictors)
    model: str | None = None  # a hub id, folder or .gguf in place of the run's model
    gguf_file: str | None = None  # a GGUF file inside `model`'s folder
    use_predictor: bool = True  # False: hybrid runs dense, no predictors read
    recall: float | None = None  # the predictors' threshold tabulated for this recall (None: as trained)
    trust_remote_code: bool = False


PRESETS: dict[str, RuntimeConfig] = {
    "hybrid": RuntimeConfig(),
    "oracle": RuntimeConfig(oracle=True),
    "dense": RuntimeConfig(mode="dense"),
    "layer-split": RuntimeConfig(mode="layer-split"),
    "hybrid-int8": RuntimeConfig(cold_dtype="int8"),
}
