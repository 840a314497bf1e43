"""Host memory of a command and its child processes, sampled from /proc (no psutil: CI may lack it).

`Monitor` starts a command and, every `interval` seconds until it exits, sums over its process tree (the command and
every descendant, found from each process's parent in /proc/PID/stat) the VmRSS, RssAnon, RssFile and RssShmem lines
of /proc/PID/status, keeping the peaks. RssAnon is what the process made (weights copied or converted, KV cache,
buffers); RssFile is file pages mapped in (a memory-mapped model read in place): together they are VmRSS. A sum over
processes counts a page shared by two of them twice (shared libraries): the stages run one process each.

Sampling misses what rises and falls between two samples; the kernel's own high-water mark of each process (VmHWM),
as last read, is kept beside the sampled peak as a check (the largest of one process, not a sum). The time of the
first stdout text that matches a pattern is recorded too (pi-generate prints its text as it is made: the first
token; pi-serve prints its URL when it listens). `snapshot(name)` records the tree's memory at a moment the caller
chooses (pi-serve after its first and its last request)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field

FIELDS = {b"VmRSS": "rss", b"RssAnon": "anon", b"RssFile": "file", b"RssShmem": "shmem", b"VmHWM": "hwm"}
TAIL = 64 << 10  # bytes of stdout/stderr kept
TREE_RESCAN_S = 0.25  # seconds between two searches of /proc for the command's descendants


@dataclass(frozen=True)
class Usage:
    """One sample: bytes summed over the process tree, `t` seconds after the start."""

    t: float
    rss: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    hwm: int = 0  # the largest VmHWM (the kernel's own peak RSS of one process) among them: not a sum
    procs: int = 0


def tree_pids(root: int) -> list[int]:
    """`root` and its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rpartition(b")")[2].split()[1])  # after "(comm)": state, ppid (comm may hold spaces)
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def process_usage(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status in bytes ({} once the process has gone; zeros for a zombie)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:  # "VmRSS:\t  1788 kB"
                name, _, value = line.partition(b":")
                if name in FIELDS:
                    out[FIELDS[name]] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def tree_usage(root: int, t: float = 0.0, pids: list[int] | None = None) -> Usage:
    """The tree's memory now: `pids` (default: found again from /proc) summed."""
    pids = tree_pids(root) if pids is None else pids
    total = dict.fromkeys(FIELDS.values(), 0)
    for pid in pids:
        for k, v in process_usage(pid).items():
            total[k] = max(total[k], v) if k == "hwm" else total[k] + v
    return Usage(t, procs=len(pids), **total)


@dataclass(frozen=True)
class Measurement:
    """What one command did: exit, wall time, first output, peak memory of its tree, snapshots, a coarse timeline."""

    command: str
    exit_code: int | None  # None: killed by us at the timeout
    timed_out: bool
    wall_s: float
    first_output_s: float | None
    first_match: str | None  # the matched text (its first group where the pattern has one)
    peak_rss_bytes: int
    peak_anon_bytes: int
    peak_file_bytes: int
    peak_shmem_bytes: int
    peak_rss_at_s: float
    hwm_bytes: int  # the kernel's high-water mark (VmHWM) of the largest single process, as last read
    samples: int
    interval_s: float
    stdout_tail: str
    stderr_tail: str
    snapshots: dict[str, dict] = field(default_factory=dict)
    timeline: list[list[float]] = field(default_factory=list)  # [t, rss, anon, file], at most ~120 rows

    def to_dict(self) -> dict:
        return asdict(self)


class _Reader(threading.Thread):
    """Drains one pipe, keeps its tail, and times the first text matching `pattern`."""

    def __init__(self, stream, t0: float, pattern: str | None, found: threading.Event):
        super().__init__(daemon=True)
        self.stream, self.t0, self.found = stream, t0, found
        self.pattern = re.compile(pattern) if pattern else None
        self.buf = bytearray()
        self.seen = bytearray()  # the text searched so far (up to TAIL), while nothing has matched
        self.match: str | None = None
        self.match_s: float | None = None

    def run(self) -> None:
        fd = self.stream.fileno()
        while chunk := os.read(fd, 65536):
            now = time.perf_counter()
            self.buf += chunk
            del self.buf[:-TAIL]
            if self.pattern is not None and self.match_s is None and len(self.seen) < TAIL:
                self.seen += chunk
                m = self.pattern.search(self.seen.decode(errors="replace"))
                if m:
                    self.match, self.match_s = (m.group(1) if m.groups() else m.group(0)), now - self.t0
                    self.found.set()
        self.found.set()  # end of output: whoever waits for a match looks again

    def text(self, chars: int = 2000) -> str:
        return self.buf.decode(errors="replace")[-chars:]


class Monitor:
    """Runs `argv` with stdout and stderr piped and samples its process tree until it exits (module docstring)."""

    def __init__(self, argv: list[str], *, env: dict | None = None, cwd: str | None = None, interval: float = 0.025,
                 first_output: str | None = None, first_output_on: tuple[str, ...] = ("stdout",)):
        self.argv, self.env, self.cwd, self.interval = argv, env, cwd, interval
        self.first_output, self.first_output_on = first_output, first_output_on
        self.found = threading.Event()
        self.samples: list[Usage] = []
        self.snapshots: dict[str, Usage] = {}
        self.exited = threading.Event()
        self.status: int | None = None

    def start(self) -> Monitor:
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=self.env, cwd=self.cwd)
        self.out, self.err = (_Reader(stream, self.t0, self.first_output if name in self.first_output_on else None,
                                      self.found) for name, stream in (("stdout", self.proc.stdout),
                                                                       ("stderr", self.proc.stderr)))
        self._threads = [self.out, self.err, threading.Thread(target=self._sample, daemon=True),
                         threading.Thread(target=self._reap, daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        if not self.exited.is_set():
            self.kill()

    def _sample(self) -> None:
        # the tree is found again only every TREE_RESCAN_S: a scan of all /proc every sample took a share of a core
        # from the measured command, whose decode uses every core (a preempted thread stalls its layer)
        pids, found = [self.proc.pid], -TREE_RESCAN_S
        while not self.exited.is_set():
            now = time.perf_counter() - self.t0
            if now - found >= TREE_RESCAN_S:
                pids, found = tree_pids(self.proc.pid), now
            u = tree_usage(self.proc.pid, now, pids)
            if u.rss:
                self.samples.append(u)  # list.append is atomic: snapshot() may read meanwhile
            self.exited.wait(self.interval)

    def _reap(self) -> None:
        # not wait4's ru_maxrss: Linux carries the forking parent's peak into it (the bench's own RSS)
        self.status = self.proc.wait()
        self.wall = time.perf_counter() - self.t0
        self.exited.set()

    def snapshot(self, name: str) -> Usage:
        """The tree's memory now, recorded under `name` (and counted among the samples)."""
        u = tree_usage(self.proc.pid, time.perf_counter() - self.t0)
        self.snapshots[name] = u
        self.samples.append(u)
        return u

    def wait_for_output(self, timeout: float | None = None) -> str | None:
        """The first stdout match (waiting up to `timeout` s); None if the output ended or the time passed first."""
        end = None if timeout is None else time.perf_counter() + timeout
        while True:
            match = self._first()
            if match is not None or not (self.out.is_alive() or self.err.is_alive()):
                return match and match[0]
            left = None if end is None else end - time.perf_counter()
            if left is not None and left <= 0:
                return None
            self.found.wait(None if left is None else min(left, 1.0))
            self.found.clear()

    def _first(self) -> tuple[str, float] | None:
        """(text, seconds) of the earliest match on the watched streams, if any."""
        hits = [(r.match, r.match_s) for r in (self.out, self.err) if r.match_s is not None]
        return min(hits, key=lambda h: h[1]) if hits else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the command and every descendant of it, by id (they are all ours)."""
        for pid in reversed(tree_pids(self.proc.pid)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None, grace: float = 20.0) -> Measurement:
        """Wait for the command to exit (killing it past `timeout`) and return what was measured."""
        timed_out = not self.exited.wait(timeout)
        if timed_out:
            self.kill(signal.SIGTERM)
            if not self.exited.wait(grace):
                self.kill()
            if not self.exited.wait(grace):
                raise RuntimeError(f"{self.argv[0]} (pid {self.proc.pid}) did not end after SIGKILL")
        for t in self._threads[:2]:
            t.join(5)
        return self._measurement(timed_out)

    def stop(self, grace: float = 20.0) -> Measurement:
        """SIGTERM now (a server), SIGKILL after `grace` seconds; what was measured."""
        if not self.exited.is_set():
            self.proc.terminate()
        return self.wait(grace)

    def _measurement(self, timed_out: bool) -> Measurement:
        s, first = self.samples or [Usage(0.0)], self._first()
        peak = max(s, key=lambda u: u.rss)
        step = max(1, len(s) // 120)
        timeline = [[round(u.t, 3), u.rss, u.anon, u.file] for u in
                    (max(s[i:i + step], key=lambda u: u.rss) for i in range(0, len(s), step))]
        return Measurement(
            command=shlex.join(self.argv), exit_code=None if timed_out else self.status, timed_out=timed_out,
            wall_s=round(self.wall, 3), first_output_s=first and round(first[1], 3),
            first_match=first and first[0], peak_rss_bytes=peak.rss, peak_anon_bytes=max(u.anon for u in s),
            peak_file_bytes=max(u.file for u in s), peak_shmem_bytes=max(u.shmem for u in s),
            peak_rss_at_s=round(peak.t, 3), hwm_bytes=max(u.hwm for u in s), samples=len(self.samples),
            interval_s=self.interval, stdout_tail=self.out.text(), stderr_tail=self.err.text(),
            snapshots={k: asdict(v) for k, v in self.snapshots.items()}, timeline=timeline)


def measure(argv: list[str], *, timeout: float | None = None, **kw) -> Measurement:
    """Run `argv` to its end under a Monitor (kw: env, cwd, interval, first_output)."""
    with Monitor(argv, **kw) as m:
        return m.wait(timeout)


class GpuMemory:
    """The driver's figure of GPU memory used by a process tree (nvidia-smi's compute apps, context included), sampled
    by one nvidia-smi that loops (--loop-ms, its output line-buffered by stdbuf where there is one) and read in a
    thread; the peak in bytes. One process for the whole run: an nvidia-smi started per sample costs a tenth of a
    second of a core each time, taken from the measured command. Where no line comes within `first_line_s` (a driver
    without loop mode, or output held in a buffer), one call a second instead."""

    QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]

    def __init__(self, root_pid: int, interval: float = 0.25, first_line_s: float = 10.0):
        self.root, self.interval, self.first_line_s, self.peak = root_pid, interval, first_line_s, 0
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._lines = 0  # lines the looping process gave
        self._pids: set[int] = set()
        self._found = -TREE_RESCAN_S
        self._last: dict[int, int] = {}  # each process's latest figure (bytes)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._watch = threading.Timer(first_line_s, self._no_lines)

    def __enter__(self) -> GpuMemory:
        import shutil

        line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
        try:
            self._proc = subprocess.Popen([*line_buffered, *self.QUERY, f"--loop-ms={int(self.interval * 1e3)}"],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no driver here: no GPU figure
            return self
        self._thread.start()
        self._watch.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._watch.cancel()
            self._stop.set()
            self._proc.terminate()
            self._proc.wait()
            self._thread.join()

    def _no_lines(self) -> None:
        if not self._lines and self._proc is not None:
            self._proc.terminate()  # the reading thread goes on to single calls

    def _read(self, lines, looping: bool = False) -> None:
        for line in lines:  # "PID, MiB" per process, a block of them each loop
            self._lines += looping
            now = time.perf_counter()
            if now - self._found >= TREE_RESCAN_S:
                self._pids, self._found = set(tree_pids(self.root)), now
                self._last = {p: b for p, b in self._last.items() if p in self._pids}  # gone: no longer counted
            pid, _, used = line.partition(",")
            try:
                pid, used = int(pid), int(used) << 20  # MiB
            except ValueError:  # a line that is not a process's ("No running processes found")
                continue
            if pid in self._pids:
                self._last[pid] = used
                self.peak = max(self.peak, sum(self._last.values()))

    def _loop(self) -> None:
        self._read(self._proc.stdout, looping=True)  # until the looping process ends: at __exit__, or refused
        while not self._stop.is_set():
            try:
                self._read(subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10).stdout.splitlines())
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(1.0)
