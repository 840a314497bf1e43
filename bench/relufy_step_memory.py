"""Peak host memory (ru_maxrss) of one pi-relufy training step of the default preset (32 rows x 256 tokens) on the
embedded SmolLM2-135M on the CPU: `parts` as pi-relufy runs it (relufy/distill.micro_rows rows at a time, gradients
summed), `whole` the batch at once. One process a mode (the peak is the process's):

    python -m bench.relufy_step_memory parts
"""
import json
import resource
import sys
import time

import torch
from hotneurons.models.family import load_model
from hotneurons.relufy import distill
from hotneurons.relufy.relufy import FFNValues, plain_model, preset


def main(mode: str) -> None:
    """One step in `mode` (parts or whole), its peak RSS printed as one JSON line."""
    torch.manual_seed(0)
    lm = load_model(None, device="cpu", dtype="float32")
    cfg = preset("default")
    teacher = plain_model(lm, torch.float32, "cpu")
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = plain_model(lm, torch.float32, "cpu", cfg.activation, cfg.fat_threshold)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr)
    vals = FFNValues(student, lm.adapter, keep=True, penalty=cfg.penalty)
    ids = torch.randint(0, student.config.vocab_size, (cfg.batch_size, cfg.seq_len))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    micro = cfg.batch_size if mode == "whole" else distill.micro_rows(cfg.seq_len, student.config.vocab_size)
    t = time.perf_counter()
    vals.reset()
    opt.zero_grad(set_to_none=True)
    for part in ids.split(micro):
        losses = distill._losses(teacher, student, vals, part, cfg, 0.0, False)
        (len(part) / len(ids) * losses["loss"]).backward()
        vals.terms.clear()
    opt.step()
    print(json.dumps({"mode": mode, "rows_a_part": micro, "batch": cfg.batch_size, "seq": cfg.seq_len,
                      "vocab": student.config.vocab_size, "peak_rss_gb_before_step": round(base, 2),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
                      "step_s": round(time.perf_counter() - t, 1)}))


if __name__ == "__main__":
    main(sys.argv[1])
