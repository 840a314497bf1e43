"""What the stages' click commands share: one-line errors that name the flags, a stdout that holds only the
--json output, and the checks a command runs before it loads a model.

Exit codes, the same in every pi-* command (docs/artifacts.md):
0 done; 1 a value names something unusable (a missing or broken file or artifact, an empty corpus, an unknown or
unreachable model, a port in use) or the work failed; 2 the command line itself is malformed (click's usage
errors: an unknown flag, a value of the wrong type or out of range, a missing required flag); 130 interrupted.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import click
from hotneurons.common.hardware import openmp_wait_policy


def cli_error(e: Exception, flags: Mapping[str, str] | None = None) -> click.ClickException:
    """`e`'s message plus, when it carries `params` (common/kinds.FixableError), the flags that set them:
    a parameter `vram_bytes` is the flag `flags["vram_bytes"]`, else `--vram-bytes`."""
    flags = flags or {}
    names = [flags.get(p, "--" + p.replace("_", "-")) for p in getattr(e, "params", ())]
    return click.ClickException(f"{e} ({', '.join(dict.fromkeys(names))})" if names else str(e))


@contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """While the block runs, whatever is written to file descriptor 1 (C libraries such as HiGHS print there
    directly, and stray Python prints) goes to stderr; stdout is restored after, for the command's --json."""
    if not enabled:
        yield
        return
    try:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):  # no fd 1 or 2 (a daemon): nothing to protect
        yield
        return
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 1)
        os.close(saved)


def check_port(host: str, port: int) -> None:
    """Refuse, in one line, an address the server could not listen on (a port in use, an unknown host), by binding
    it for a moment: before a model loads, not after."""
    if not 0 < port <= 65535:  # 0: any free port; out of range: the command's own check says so
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise click.ClickException(f"cannot listen on host '{host}': {e.strerror} (--host)") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: a port in TIME_WAIT is free
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise click.ClickException(f"port {port} on {host} is in use: stop what listens there, or pass "
                                           f"another --port (0: any free one)") from None
            raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror} (--host, --port)") from None


def parse_sparsities(text: str, flag: str) -> tuple[float, ...]:
    """A comma list of sparsities in [0, 1), refused with a click usage error (exit 2) naming the value."""
    try:
        out = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        out = ()
    if not out or any(not 0 <= v < 1 for v in out):
        raise click.BadParameter(f"{text!r} is not a comma list of sparsities in [0, 1), e.g. 0.25,0.4,0.5",
                                 param_hint=flag)
    return out


def interrupted(message: str) -> None:
    """Ctrl-C: one line on stderr saying what was kept, exit code 130. Progress bars still open (the signal can land
    between a bar's creation and its `with`) are closed first, so none is redrawn after the line."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    click.echo(f"\ninterrupted: {message}", err=True)
    sys.exit(130)


class StageCommand(click.Command):
    """A pi-* command whose Ctrl-C ends in one line and exit code 130 wherever it lands (click's own handler says
    "Aborted!" and exits 1: an interrupt while torch imports, before a command's own handler is in place), and
    that removes the run folder it created when an interrupt leaves it empty (never one that existed before). Its
    OpenMP threads sleep or spin as common/hardware.openmp_wait_policy chooses, set before the command imports torch
    (torch's default spins, and on a busy machine spinning threads take the cores the others wait for).

    `run_folder(params)`: the folder the command writes into, from its parsed flags (None: it writes none)."""

    def __init__(self, *args, run_folder: Callable[[dict], str | os.PathLike | None] | None = None, **kw):
        super().__init__(*args, **kw)
        self.run_folder = run_folder

    def invoke(self, ctx: click.Context):
        openmp_wait_policy()  # before the command's torch import (common/hardware.py says why)
        new = new_folders(self.run_folder(ctx.params) if self.run_folder else None)
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            removed = remove_empty(new)
            interrupted(f"{ctx.command_path} stopped before its work began, nothing was written"
                        + (f" (the empty folder {removed} it had made is removed)" if removed else "")
                        + ": run the same command again")
        except SystemExit as e:  # a command's own interrupted(): its line is out, the folder goes quietly
            if e.code == 130:
                remove_empty(new)
            raise


def new_folders(folder: str | os.PathLike | None) -> list[Path]:
    """`folder` and its ancestors that do not exist yet, deepest first: what a command may create."""
    out: list[Path] = []
    p = Path(folder).absolute() if folder is not None else None
    while p is not None and not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def remove_empty(new: list[Path]) -> Path | None:
    """Remove the folders of `new` (from `new_folders`) that hold no file, only empty folders if any; returns the
    outermost removed. A folder that holds a file stays whole, with its parents."""
    removed = None
    for top in new:
        if not top.is_dir():
            continue
        walk = list(os.walk(top, topdown=False))  # (folder, subfolders, files), each folder after its subfolders
        if any(files for _, _, files in walk):
            break
        try:
            for folder, _, _ in walk:
                os.rmdir(folder)
        except OSError:  # something appeared meanwhile: it stays
            break
        removed = top
    return removed


def bench_main(root: str | os.PathLike | None = None) -> None:
    """The pi-bench console script. bench/ is not in the wheel: it sits beside the package's rooms in a checkout, and
    in an editable install the package's folder is the checkout's root (`root`, by default this file's room's
    parent). This process becomes `python -m bench.pi_bench` with that root first on PYTHONPATH, as the docs run it
    from a checkout; without bench/ there (a wheel), one line says why. No room imports bench (tests/test_rooms.py)."""
    root = Path(__file__).resolve().parents[1] if root is None else Path(root).resolve()
    if not (root / "bench" / "pi_bench.py").is_file():
        sys.exit(f"pi-bench runs from a checkout of the repository (clone it, then `pip install -e .` in it): bench/ "
                 f"is not in the wheel, and {root} holds none")
    path = [str(root), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(root))]
    os.execve(sys.executable, [sys.executable, "-m", "bench.pi_bench", *sys.argv[1:]],
              {**os.environ, "PYTHONPATH": os.pathsep.join(path)})
