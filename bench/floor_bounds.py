"""The floor goal's bound across pi_bench results: for each run, the serial floor with the cold rows read at the cold
kernel's own measured rate (bench_ceilings.floor_bound), as a share of the run's floor, and the kernel's share of
DRAM that 0.7 of the floor would need with nothing else lost. Computed from the results files' measurements only.

Usage: python bench/floor_bounds.py OUT.json RESULTS.json [RESULTS.json ...]   (writes OUT.json and OUT.md)"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ceilings as ceil  # noqa: E402


def bound_of(res: dict) -> dict | None:
    """One pi_bench result's floor bound (None without a hybrid, a serial floor and the bf16 kernel's rows)."""
    hybrid = res.get("systems", {}).get("hybrid")
    kern = (res.get("kernel") or {}).get("rows")
    if not hybrid or "error" in hybrid or not kern or "serial_tokens_per_s" not in res.get("floor", {}):
        return None
    m = res["model"]
    b = ceil.floor_bound(hybrid, res["ceilings"], m["shape"], m["layers"], res["predictors"]["bytes"], kern,
                         res["floor"]["tokens_per_s"])
    tps = hybrid["decode_tokens_per_s"]
    return {"machine_label": res.get("machine_label"), "commit": res.get("commit"), "created": res.get("created"),
            "hybrid_tokens_per_s": tps, "floor_tokens_per_s": res["floor"]["tokens_per_s"],
            "serial_floor_tokens_per_s": res["floor"]["serial_tokens_per_s"],
            "hybrid_share_of_floor": tps / res["floor"]["tokens_per_s"],
            "hybrid_share_of_bound": tps / b["serial_tokens_per_s"], **b}


def main(out: Path, inputs: list[Path]) -> dict:
    rows = []
    for p in inputs:
        b = bound_of(json.loads(p.read_text()))
        if b:
            rows.append({"file": p.name, **b})
    shares = [r["share_of_floor"] for r in rows]
    res = {"command": "python " + " ".join(sys.argv), "runs": rows,
           "median_bound_share_of_floor": float(np.median(shares)) if shares else None,
           "runs_with_bound_below_goal": sum(s < 0.7 for s in shares),
           "note": ceil.floor_bound.__doc__.split("\n\n")[1].replace("\n    ", " ").strip()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    lines = ["| run | machine | hybrid tok/s | floor | serial floor | bound (cold rows at the kernel's rate, the rest "
             "at its floor) | bound / floor | kernel / DRAM at its sparsest | kernel / DRAM 0.7 of the floor needs | "
             "hybrid / bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['machine_label'] or '?'} | {r['hybrid_tokens_per_s']:.1f} | "
                     f"{r['floor_tokens_per_s']:.1f} | {r['serial_floor_tokens_per_s']:.1f} | "
                     f"{r['serial_tokens_per_s']:.1f} | {r['share_of_floor']:.3f} | {r['kernel_share_of_dram']:.2f} "
                     f"({100 * r['kernel_density']:.0f}%) | {r['kernel_share_needed']:.2f} | "
                     f"{r['hybrid_share_of_bound']:.3f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    a = ap.parse_args()
    main(a.out, a.inputs)
