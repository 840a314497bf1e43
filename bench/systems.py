"""The systems pi-bench runs, in one table: a new system is one row here (its name, what it is, the seconds a run
of it takes at the 70B shape, and for ours the RuntimeConfig fields it sets over the hybrid's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class System:
    name: str
    help: str
    estimate_s: float  # seconds a run takes at the 70B shape: --time-limit plans with it
    runner: str = "ours"  # "ours" (bench_systems), "llama.cpp" (bench_llamacpp), "accelerate" (its own process)
    fields: dict[str, Any] = field(default_factory=dict)  # RuntimeConfig fields over the budgeted hybrid's
    placed: bool = True  # reads the placement and the predictors
    slow: bool = False  # decodes --slow-tokens once instead of --tokens --reps times


_DENSE = {"mode": "dense"}
SYSTEMS = {s.name: s for s in (
    System("hybrid", "hot neurons on the GPU, the active cold ones on the CPU (the default)", 60),
    System("layer-split", "whole layers on the GPU up to the budget, the rest on the CPU", 60,
           fields={"mode": "layer-split"}, placed=False, slow=True),
    System("all-gpu", "our runtime with every neuron on the GPU (no budget)", 40, fields={**_DENSE, "vram": None},
           placed=False),
    System("hybrid-int8", "hybrid with int8 cold rows", 60, fields={"cold_dtype": "int8"}),
    System("dense", "the hybrid's layout, every cold neuron computed on the CPU", 60, fields=_DENSE, slow=True),
    System("hybrid-no-prelaunch", "hybrid with each graph launched after the previous cold part", 60,
           fields={"prelaunch": False}),
    System("hybrid-no-pcie", "hybrid with the CPU reading every cold row (--pcie-share 0)", 60,
           fields={"pcie_share": 0.0}),
    System("hybrid-no-pcie-no-prelaunch", "both of the above", 60, fields={"pcie_share": 0.0, "prelaunch": False}),
    System("hybrid-no-balance", "hybrid keeping the PCIe share measured at start (no balancing rounds)", 60,
           fields={"pcie_balance": False}),
    System("hybrid-compiled", "hybrid with torch.compile on the small GPU ops", 60, fields={"ops": "compile"}),
    System("hybrid-torch-ops", "hybrid with torch's kernels for the small GPU ops", 60, fields={"ops": "torch"}),
    System("hybrid-no-recheck", "hybrid keeping the PCIe share of its first balancing rounds for life", 60,
           fields={"pcie_recheck": False}),
    System("llama.cpp", "llama-bench -ngl at the budget, all layers on the GPU, and the CPU alone", 45,
           runner="llama.cpp"),
    System("accelerate", "transformers with accelerate's offload at the budget", 60, runner="accelerate"),
)}
DEFAULT = ("hybrid", "layer-split", "all-gpu", "hybrid-int8", "llama.cpp", "accelerate")
LLAMA_ROUND_S = 10  # one llama-bench -r 1 after each round of --interleave


def parse(names: str) -> set[str]:
    """A comma list of system names, each checked against SYSTEMS (ValueError names the unknown one)."""
    from hotneurons.common.kinds import choose

    return {choose(n.strip(), SYSTEMS, "system") for n in names.split(",") if n.strip()}


def help_text() -> str:
    return "comma list of: " + "; ".join(f"{s.name}: {s.help}" for s in SYSTEMS.values())
