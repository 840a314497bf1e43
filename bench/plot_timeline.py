"""Plot one decode token's per-layer FFN timeline (CPU kernel vs GPU hot rows) from a runtime_gpu_check.py result.

Usage: python -m bench.plot_timeline [bench/results/runtime_gpu_h100_omp_active.json]
                                     [notebooks/figures/runtime_timeline_h100.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str = "bench/results/runtime_gpu_h100_omp_active.json",
         dst: str = "notebooks/figures/runtime_timeline_h100.png") -> None:
    res = json.loads(Path(src).read_text())
    rows = res["speed"]["timing"]["timeline_one_token"]  # one token, per layer, ms from that FFN's start
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for k, r in enumerate(rows):
        y = len(rows) - 1 - k
        ax.barh(y + 0.18, r["cpu_end_ms"] - r["cpu_start_ms"], left=r["cpu_start_ms"], height=0.34, color="tab:blue",
                label="CPU: Numba kernel, active cold rows" if k == 0 else None)
        ax.barh(y - 0.18, r["gpu_hot_end_ms"] - r["gpu_hot_start_ms"], left=r["gpu_hot_start_ms"], height=0.34,
                color="tab:orange", label="GPU: hot rows (CUDA graph)" if k == 0 else None)
        ax.plot([r["ffn_ms"]] * 2, [y - 0.4, y + 0.4], color="black", lw=1,
                label="FFN done (partial sums added)" if k == 0 else None)
    ax.set_yticks(range(len(rows)), [f"layer {r['layer']} ({r['active_cold']} cold)" for r in reversed(rows)])
    ax.set_xlabel("ms from the FFN's start (one decode token)")
    s = res["speed"]
    ax.set_title(f"{s['shape']}-shaped, {s['layers']} layers, random weights, synthetic 90% sparsity: "
                 f"{res['machine'].get('gpu')}", fontsize=9)
    ax.set_xlim(0, None)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 * 9 / (len(rows) + 1)), ncol=3, fontsize=8)
    fig.tight_layout()
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=120)
    print("wrote", dst)


if __name__ == "__main__":
    main(*sys.argv[1:])
