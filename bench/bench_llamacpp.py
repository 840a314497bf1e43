"""llama.cpp for pi-bench: the source tarball (made where PyPI is reachable), the build of `llama-bench`, a GGUF of
the bench model's weights, and `llama-bench` runs (through fair.run: standalone, or paired with our process stopped).

The source is vendor/llama.cpp of the `llama-cpp-python` sdist (77 MB, too large to carry to a machine without
internet), tarred without models/ docs/ tests/ examples/ and the like into CARRY (git-ignored, never committed)."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as version_of
from pathlib import Path

from bench import ROOT, fair

CARRY = ROOT / ".llamacpp"  # carried to the GPU machine: llama.cpp.tar.gz
TARBALL = CARRY / "llama.cpp.tar.gz"
WHEELS = ROOT / ".whl"  # carried too: the wheels of the packages a GPU image may lack
DROP = {"models", "docs", "tests", "examples", ".github", "media", "ui", "pocs", ".devops", "benches", "app", "ci"}
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]
# the solver's packages, the GGUF writer, and pi-serve's web stack (bench/serve_bench.py on the GPU machine)
WHEEL_NAMES = ("pulp", "highspy", "gguf", "fastapi", "starlette", "uvicorn", "h11", "pydantic", "pydantic_core",
               "annotated_types", "typing_inspection", "anyio", "annotated_doc", "opentelemetry_api")
# pulp 3 and later import orloge and its dependencies, which the GPU image lacks; pulp 2 needs nothing
DEVICE_PINS = {"pulp": "pulp>=2.8,<3"}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def prepare(python_version: str | None = None) -> dict:
    """Download the llama-cpp-python sdist, tar its vendor/llama.cpp (trimmed) into CARRY; fetch the wheels of
    WHEEL_NAMES for the GPU machine's Python (default: this one's) into WHEELS. Needs PyPI."""
    python_version = python_version or ".".join(platform.python_version_tuple()[:2])
    CARRY.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps", "-d", tmp,
              "llama-cpp-python"])
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))

        def keep(m: tarfile.TarInfo) -> str | None:
            parts = m.name.split("/")
            if len(parts) < 3 or parts[1:3] != ["vendor", "llama.cpp"]:
                return None
            rel = parts[3:]
            if rel and (rel[0] in DROP or (len(rel) > 1 and rel[0] == "tools" and rel[1] in DROP | {"server"})):
                return None
            return "/".join(["llama.cpp", *rel])

        with tarfile.open(sdist) as src, tarfile.open(TARBALL, "w:gz") as dst:
            for m in src.getmembers():
                name = keep(m)
                if name is None:
                    continue
                f = src.extractfile(m) if m.isfile() else None
                m.name = name
                m.pax_headers.pop("path", None)  # a long name's PAX record would override the new name
                dst.addfile(m, f)
        version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    WHEELS.mkdir(exist_ok=True)
    plats = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["--platform=manylinux2014_x86_64"]
    for name in WHEEL_NAMES:
        if any(p.name.lower().startswith(f"{name}-") for p in WHEELS.glob("*.whl")):  # one wheel a package: two
            continue  # versions would conflict at install
        try:  # the versions the project is tested with here
            name = DEVICE_PINS.get(name) or f"{name}=={version_of(name)}"
        except PackageNotFoundError:
            pass
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
              "cp", "--python-version", python_version, *plats, "-d", str(WHEELS), name])
    info = {"llama_cpp_python": version, "tarball": str(TARBALL.relative_to(ROOT)),
            "tarball_bytes": TARBALL.stat().st_size, "wheels": sorted(p.name for p in WHEELS.glob("*.whl"))}
    (CARRY / "prepared.json").write_text(json.dumps(info, indent=1))
    return info


def source_dir(work: Path) -> Path:
    src = work / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        if not TARBALL.exists():
            raise SystemExit(f"no {TARBALL}: run `pi-bench --stage prepare` where PyPI is reachable and carry "
                             f".llamacpp")
        with tarfile.open(TARBALL) as t:
            t.extractall(work, filter="data")
    return src


def gguf_module(work: Path):
    """The gguf package (installed, or carried as a wheel to a machine without a package index)."""
    try:
        import gguf
    except ImportError:
        raise SystemExit("the gguf package is missing: pip install gguf, or carry its wheel in .whl/ "
                         "(pi-bench --stage prepare puts it there)") from None
    return gguf


def build(work: Path, cuda: bool, jobs: int) -> dict:
    """cmake + ninja, targets llama-bench, llama-quantize and llama-batched-bench (pi-serve's batched comparison).
    Returns llama-bench's path and the seconds taken."""
    missing = [t for t in ("cmake", "ninja") + (("nvcc",) if cuda else ()) if shutil.which(t) is None]
    if cuda and shutil.which("nvcc") is None and Path("/usr/local/cuda/bin/nvcc").exists():
        missing.remove("nvcc")
    if missing:
        raise SystemExit(f"cannot build llama.cpp: {', '.join(missing)} not found on PATH")
    src = source_dir(work)
    out = work / ("build-cuda" if cuda else "build-cpu")
    binary = out / "bin" / "llama-bench"
    if binary.exists() and (out / "bin" / "llama-quantize").exists():
        return {"binary": str(binary), "seconds": 0.0, "cached": True}
    flags = CMAKE_FLAGS + (["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"] if cuda else ["-DGGML_CUDA=OFF"])
    t0 = time.perf_counter()
    _run(["cmake", "-G", "Ninja", "-S", str(src), "-B", str(out), *flags])
    _run(["cmake", "--build", str(out), "--target", "llama-bench", "-j", str(jobs)])
    row = {"binary": str(binary), "seconds": time.perf_counter() - t0, "cached": False, "cmake_flags": flags}
    for target in ("llama-quantize", "llama-batched-bench"):  # the 8-bit and the batched comparisons only: their
        try:  # failure must not cost the fp16 one
            _run(["cmake", "--build", str(out), "--target", target, "-j", str(jobs)])
        except subprocess.CalledProcessError as e:
            row[f"{target.removeprefix('llama-').replace('-', '_')}_error"] = str(e)
    return {**row, "seconds": time.perf_counter() - t0}


def write_gguf(model, path: Path, gguf=None) -> dict:
    """The model's weights as an fp16 GGUF (arch llama, norms fp32, q/k in llama.cpp's RoPE layout, a placeholder
    vocabulary), streamed tensor by tensor (the whole model never sits in host memory twice), to a temp name and
    renamed (a stopped build leaves no GGUF that a later one would take for whole): hotneurons.export.gguf_model.
    `gguf`: unused, kept for callers that pass the module gguf_module found."""
    from hotneurons.export.gguf_model import hf_state, llama_metadata, llama_tensors, placeholder_vocab
    from hotneurons.export.gguf_model import write_gguf as write

    cfg = model.config
    vocab = placeholder_vocab(cfg.vocab_size)

    def metadata(w):
        llama_metadata(w, cfg, "pi-bench random ReLU-gated llama")
        vocab.add_to(w)

    return write(path, "llama", metadata, llama_tensors(hf_state(model), cfg))


def quantize(binary_dir: Path, src: Path, dst: Path, kind: str = "Q8_0", threads: int = 16) -> dict:
    """`llama-quantize src dst kind threads`: the same model with 8-bit weights (Q8_0: 32 weights share an fp16
    scale, 34 bytes per 32), written to a temp name and renamed."""
    tmp = dst.with_suffix(".partial")
    t0 = time.perf_counter()
    _run([str(binary_dir / "llama-quantize"), str(src), str(tmp), kind, str(threads)])
    tmp.rename(dst)
    return {"path": str(dst), "kind": kind, "file_bytes": dst.stat().st_size, "seconds": time.perf_counter() - t0}


def llama_bench(binary: str, gguf_path: Path, ngl: int, threads: int, tokens: int, reps: int,
                timeout: float, freeze: bool = False) -> dict:
    """One `llama-bench` run (decode only: -p 0 -n tokens); tokens/s from its JSON. freeze: this process is stopped
    while it runs (a paired run beside our systems: fair.py)."""
    cmd = [binary, "-m", str(gguf_path), "-ngl", str(ngl), "-p", "0", "-n", str(tokens), "-r", str(reps),
           "-t", str(threads), "-o", "json"]
    rc, stdout, stderr, seconds = fair.run(cmd, timeout, freeze=freeze)
    row = {"command": " ".join(cmd), "seconds": seconds, "returncode": rc, "ours_stopped": freeze}
    if rc == 124:
        return {**row, "error": f"timed out after {timeout:.0f} s"}
    if rc != 0:
        return {**row, "error": (stderr or stdout)[-2000:]}
    res = json.loads(stdout)[0]
    return {**row, "decode_tokens_per_s": res["avg_ts"], "stddev_tokens_per_s": res.get("stddev_ts"),
            "n_gpu_layers": res.get("n_gpu_layers"), "build_commit": res.get("build_commit"),
            "backends": res.get("backends"), "model_size": res.get("model_size"), "samples_ts": res.get("samples_ts")}
