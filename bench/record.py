"""The one results writer of bench: every results file has the same top-level keys.

    {"schema_version": 1,
     "machine": {hostname, cpu_model, nproc, gpu, gpu_count, mem_total_gib, ... as measured on the machine},
     "machine_kind": "nvidia-h200" | "nvidia-h200-x2" | "cpu" | ... (a flag, else detected from the GPU's name),
     "commit": the checkout's git commit (or what --commit said where the checkout has no .git), "unknown" else,
     "command": the command line that produced the figures,
     "created": ISO time (local, seconds),
     "figures": {...}}  # what the script measured: its own keys

Files are written to a temp name and renamed, so a stopped run never leaves half a file."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA_VERSION = 1
HEADER = ("schema_version", "machine", "machine_kind", "commit", "command", "created")
ROOT = Path(__file__).resolve().parents[1]


def machine(*packages: str) -> dict:
    """The machine as measured here: common.hardware.machine_info (CPU, cores, GPU, versions of `packages`) plus the
    hostname, the GPU count and the RAM."""
    from hotneurons.common.hardware import machine_info

    info = {"hostname": socket.gethostname(), **machine_info(*packages)}
    try:
        import torch

        info["gpu_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        info["gpu_count"] = 0
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        info["mem_total_gib"] = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return info


def machine_kind(info: dict) -> str:
    """"nvidia-h200" from a GPU named "NVIDIA H200" (one GPU), "nvidia-h200-x2" for two of them, "cpu" without one."""
    gpu = info.get("gpu")
    if not gpu:
        return "cpu"
    m = re.search(r"(H100|H200|H20|B200|A100|A10G?|L40S?|L4|RTX ?\d{4}|T4|V100)", gpu, re.I)
    kind = "nvidia-" + m.group(1).lower().replace(" ", "") if m else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    n = info.get("gpu_count") or 1
    return kind if n <= 1 else f"{kind}-x{n}"


def git_commit(default: str | None = None) -> str:
    """The checkout's commit (short hash, "+dirty" with uncommitted changes to tracked files), else `default`, else
    "unknown" (a copy of the tree without .git, as on a lent machine: pass --commit there)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return default or "unknown"


def command_line(argv: list[str] | None = None) -> str:
    prog = Path(sys.argv[0]).name
    return " ".join([prog if prog.startswith("pi-") else "python " + sys.argv[0], *(sys.argv[1:] if argv is None
                                                                                    else argv)])


def make(figures: dict, *, machine_info: dict | None = None, kind: str | None = None, commit: str | None = None,
         command: str | None = None, created: str | None = None) -> dict:
    """A results record: the fixed header (measured here unless given) and `figures`."""
    info = machine_info if machine_info is not None else machine()
    return {"schema_version": SCHEMA_VERSION, "machine": info, "machine_kind": kind or machine_kind(info),
            "commit": commit or git_commit(), "command": command or command_line(),
            "created": created or time.strftime("%Y-%m-%dT%H:%M:%S"), "figures": figures}


def _json(o):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def write(path: Path | str, rec: dict) -> Path:
    """Write a record made by `make` (checked: the header's keys and figures), atomically."""
    missing = [k for k in (*HEADER, "figures") if k not in rec]
    if missing:
        raise ValueError(f"not a results record: no {', '.join(missing)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec, indent=1, default=_json))
    tmp.replace(path)
    return path


def write_result(path: Path | str, figures: dict, **header) -> dict:
    """make + write: the scripts' one call."""
    rec = make(figures, **header)
    write(path, rec)
    return rec


def write_dated(name: str, figures: dict, *, path: Path | str | None = None, kind: str | None = None,
                commit: str | None = None, packages: tuple[str, ...] = ("torch", "transformers", "gguf")) -> dict:
    """write_result measured here, to `path` or bench/results/<date>-<machine kind>-<name>.json."""
    info = machine(*packages)
    kind = kind or machine_kind(info)
    path = Path(path or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{kind}-{name}.json")
    rec = write_result(path, figures, machine_info=info, kind=kind, commit=git_commit(commit))
    print(f"wrote {path}", file=sys.stderr)
    return rec


def write_flat(path: Path | str, res: dict, **header) -> dict:
    """A script's flat results dict written as a record: its own "machine" (merged over the measured one), "command",
    "created" and "commit" keys, where it has them, go to the header; the rest are the figures."""
    res = dict(res)
    info = {**machine(), **(res.pop("machine", None) or {})}
    hdr = {"machine_info": info, **{k: res.pop(k, None) for k in ("command", "created", "commit")}}
    hdr.update({k: v for k, v in header.items() if v is not None})
    return write_result(path, res, **hdr)


def read(path: Path | str) -> dict:
    """A results record; a file written before the schema (flat keys) comes back in the schema's shape, its header
    taken from the keys it has."""
    d = json.loads(Path(path).read_text())
    if d.get("schema_version") == SCHEMA_VERSION:
        return d
    header = {k: d.pop(k, None) for k in ("machine", "command", "created", "commit")}
    info = header["machine"] or {}
    return {"schema_version": SCHEMA_VERSION, "machine": info, "machine_kind": d.pop("machine_kind", None)
            or machine_kind(info), "commit": header["commit"] or "unknown", "command": header["command"] or "",
            "created": header["created"] or "", "figures": d}


def flat(rec: dict) -> dict:
    """The figures with the header's keys beside them (what pi_bench's report functions read)."""
    return {**rec["figures"], **{k: rec[k] for k in HEADER}}
