"""Ways to count active neurons over a (tokens, neurons) activation tensor on the GPU; the profiler uses the
fastest exact one. `python bench/count_variants.py` prints ms per call for LLaMA-2-7B and -70B FFN widths."""

import json
import sys

import torch


def timed(f, reps=50) -> float:
    f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps  # ms


def variants(tau: float):
    ones = {}

    def gemv(h):  # exact: fp16 holds integers up to 2048, so sum token chunks of <= 2048 in fp32
        m = (h.abs() > tau).to(torch.float16)
        out = torch.zeros(h.shape[1], dtype=torch.float32, device=h.device)
        for c in range(0, h.shape[0], 2048):
            blk = m[c:c + 2048]
            if blk.shape[0] not in ones:
                ones[blk.shape[0]] = torch.ones(1, blk.shape[0], dtype=torch.float16, device=h.device)
            out += (ones[blk.shape[0]] @ blk).float()[0]
        return out.long()

    compiled = torch.compile(lambda h: (h.abs() > tau).sum(0))
    return {
        "abs_gt_sum": lambda h: (h.abs() > tau).sum(0),
        "abs_gt_count_nonzero": lambda h: torch.count_nonzero(h.abs() > tau, dim=0),
        "abs_gt_int32_sum": lambda h: (h.abs() > tau).sum(0, dtype=torch.int32),
        "count_nonzero_raw(tau=0)": lambda h: torch.count_nonzero(h, dim=0),
        "ne0_sum(tau=0)": lambda h: (h != 0).sum(0),
        "gemv_fp16_chunks": gemv,
        "torch_compile_abs_gt_sum": compiled,
    }


def main():
    torch.manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ms": {}}
    for name, (tokens, n) in {"llama-2-7b": (4096, 11008), "llama-2-70b": (4096, 28672)}.items():
        h = torch.relu(torch.randn(tokens, n, device="cuda", dtype=torch.float16))
        ref = (h.abs() > 0.5).sum(0)
        row = {}
        for vname, f in variants(0.5).items():
            if "tau=0" not in vname:
                assert torch.equal(f(h).long(), ref), vname
            row[vname] = round(timed(lambda: f(h)), 4)
        row["read_bound_ms"] = round(h.numel() * 2 / 3.0e12 * 1e3, 4)  # one read of h at ~3 TB/s
        out["ms"][f"{name} ({tokens}x{n} fp16)"] = row
    print(json.dumps(out, indent=2))
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
