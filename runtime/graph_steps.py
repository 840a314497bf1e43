"""`GraphSteps`: batch-1 decode steps whose GPU work is replayed from CUDA graphs, with the CPU's cold rows between
them. The model's part of a step is its subclass's (runtime/static_decoder.py: a transformers LLaMA; runtime/engine.py:
our decoders); this is the runner, the same for both:

  pre[i]:  layer i's input from layer i-1's outputs (layer 0: the token's embedding), attention with the cache, the
           FFN's input x[i], the predictor; x and the cold mask written to the host; a signal the CPU waits for
  hot[i]:  the hot FFN rows of x[i] -> hot_sum[i]
  CPU:     one Numba call (HybridFFN.cold_rows): the active cold rows' per-thread partial sums into a pinned host
           buffer, which pre[i+1]'s first kernel reads over PCIe and adds up (HybridFFN.cold_sum), no copy node
  final:   the last layer's output, the final norm and the head -> logits

pre[i] and hot[i] are one graph with an event recorded between them (torch.cuda.Event(external=True)); torch versions
without external events get two graphs per layer.

Prelaunch: launching a layer's graph costs the CPU time (docs/history.md). So that it is not spent between a layer's
cold part and the next layer's GPU work, the graph of layer i+1 is launched before the CPU computes layer i's cold
rows, and its first node waits on the GPU for a flag in pinned host memory (cuda.HostFlags) that the CPU sets once the
cold sum is written. Each graph also sets a ready flag after `pre`, which the CPU's Numba call spins on instead of a
CUDA event wait. Where the driver lacks the stream memory operations (or RuntimeConfig.prelaunch is off), each graph
is launched after the previous cold part. Without CUDA (or graphs) the same pieces run eagerly.
"""

from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from hotneurons.kernels.ops import Ops
from hotneurons.runtime.cuda import HostFlags, capture
from hotneurons.runtime.hybrid_ffn import HybridFFN


@dataclass(frozen=True)
class _LayerGraphs:
    graphs: tuple[torch.cuda.CUDAGraph, ...]  # (pre and hot,), or (pre, hot) where torch has no external events
    done: torch.cuda.Event  # after pre: x and the cold mask are on the host


@dataclass(frozen=True)
class _Graphs:
    layers: list[_LayerGraphs]
    final: torch.cuda.CUDAGraph
    logits: torch.Tensor  # (vocab,) the final graph's static output


class GraphSteps:
    """The runner of decode steps. A subclass sets `x` and `hot_sum` (per layer, (1, d) on the device: the FFN's
    input and its hot rows' sum) and defines set_input, pre, _final and cache_tensors."""

    x: list[torch.Tensor]
    hot_sum: list[torch.Tensor]

    def __init__(self, ffns: list[HybridFFN], device: torch.device, graphs: bool, capacity: int, ops: str = "torch",
                 prelaunch: bool = True):
        self.ffns, self.device, self.capacity = ffns, device, capacity
        self.graphs = graphs and device.type == "cuda"
        self.ops_name = ops if self.graphs else "torch"  # eager steps read only the filled slots already
        self.ops = Ops.named(self.ops_name)
        self._graphs: _Graphs | None = None
        self.allow_prelaunch = prelaunch  # RuntimeConfig.prelaunch
        self.flags: HostFlags | None = None  # opened at the first capture that may prelaunch
        self.prelaunch: bool | None = None  # whether the captured graphs prelaunch (None: none captured yet)
        self._filled: int | None = None  # eager steps: cache slots in use (None while capturing graphs)
        # set to [] to record each graph step's host timeline (_record); the PCIe share's balancing does
        self.timing: list[dict] | None = None
        for f in ffns:
            f.host_io(device)  # host buffers, made before any capture

    # -- the model's part --------------------------------------------------------------------------------------
    def set_input(self, token: int, position: int) -> None:
        """The step's token and position into the static buffers the graphs read."""
        raise NotImplementedError

    def pre(self, i: int) -> None:
        """Layer i's work before its FFN, ending with ffns[i].to_host (x and the cold mask to the host)."""
        raise NotImplementedError

    def _final(self) -> torch.Tensor:
        """(vocab,) logits from the last layer's outputs."""
        raise NotImplementedError

    def cache_tensors(self) -> list[torch.Tensor]:
        """What the steps write besides the FFNs' counts (the KV cache): kept as they were by warm-up and capture."""
        raise NotImplementedError

    def _hot(self, i: int) -> None:
        self.hot_sum[i].copy_(self.ffns[i].device_part(self.x[i]))

    # -- graphs --------------------------------------------------------------------------------------------------
    def _capture(self) -> _Graphs:
        """Per layer one graph of pre, the event's record and hot; or (pre, hot) with an event recorded between their
        launches where torch has no external events. Then the final graph. Prelaunched, the graph of layer i > 0 and
        the final one first wait for flag i - 1 (layer i - 1's cold sum written), and each signals after pre."""
        # prelaunch holds the stream while the CPU computes a cold part, so that part must not use the GPU: the
        # oracle mask (a correctness check) counts hot activations there
        if self.allow_prelaunch and all(f.mask != "oracle" for f in self.ffns):
            # all 0 after a whole step (each graph resets the flag it waited for), so a new capture reuses them
            self.flags = self.flags or HostFlags.open(len(self.ffns), self.device)
        self.prelaunch = prelaunch = self.allow_prelaunch and self.flags is not None
        L = len(self.ffns)
        try:  # events recorded inside a graph that the host waits for: pre and hot in one graph
            done, external = [torch.cuda.Event(external=True) for _ in self.ffns], True
        except TypeError:  # torch without them: recorded between two graphs' launches
            done, external = [torch.cuda.Event() for _ in self.ffns], False

        def wait_for_flag(i: int) -> None:  # the first node of layer i's graph (i == L: the final one)
            if prelaunch and i > 0:
                self.flags.wait(i - 1)  # layer i - 1's cold sum is written

        def pre(i: int) -> None:
            wait_for_flag(i)
            self.pre(i)
            if prelaunch:
                self.flags.signal(i)  # x and the cold mask are on the host

        def layer(i: int) -> None:  # pre and hot in one graph, the host's event recorded between them
            pre(i)
            done[i].record()
            self._hot(i)

        def final() -> torch.Tensor:
            wait_for_flag(L)
            return self._final()

        pieces = []
        for i in range(L):
            pieces += [partial(layer, i)] if external else [partial(pre, i), partial(self._hot, i)]
        pieces.append(final)

        def step() -> None:  # the warm-up: no flags, which nothing would release
            for i in range(L):
                self.pre(i)
                self._hot(i)
            self._final()

        keep = [*(t for f in self.ffns for t in (f.fired, getattr(f, "hot_passed", None)) if t is not None),
                *self.cache_tensors()]  # warm-up and capture: nothing that counts
        try:
            graphs, outputs = capture(self.device, pieces, keep, warm=step)
        except Exception as e:
            if self.ops_name == "torch":
                raise
            warnings.warn(f"{self.ops_name} ops failed ({type(e).__name__}: {e}); the decode steps run the torch "
                          f"ops", stacklevel=2)
            self.ops_name, self.ops = "torch", Ops()
            graphs, outputs = capture(self.device, pieces, keep, warm=step)
        per = 1 if external else 2
        layers = [_LayerGraphs(tuple(graphs[per * i:per * i + per]), done[i]) for i in range(L)]
        return _Graphs(layers, graphs[-1], outputs[-1])

    def reset_graphs(self) -> None:
        """Drop the captured graphs (e.g. after an FFN's mapped_rows changed): the next step captures them again.
        Waits for the device first, so no graph (this decoder's or an FFN's own) is running when dropped."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._graphs = None

    # -- use ---------------------------------------------------------------------------------------------------
    def load_prefill(self, n: int) -> None:
        """Take over a prefill of n tokens (the model's `prefill`, runtime/lm.py) before the first step: its keys and
        values into the cache the steps read. Nothing here: our decoders' steps read the cache prefill wrote."""

    @torch.inference_mode()
    def step(self, token: int, position: int) -> torch.Tensor:
        """Logits (vocab,) after `token` at `position` (all earlier positions in the cache)."""
        if position >= self.capacity:
            raise ValueError(f"position {position} is past the static cache ({self.capacity} tokens)")
        self.set_input(token, position)
        if self.graphs and self._graphs is None:
            self._graphs = self._capture()
        if self._graphs is None:  # eager: the same pieces
            self._filled = position + 1
            for i, f in enumerate(self.ffns):
                self.pre(i)
                self._hot(i)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                f.cold_rows(self.x[i])
            return self._final()
        return self._replay()

    def _launch(self, i: int) -> None:
        """Layer i's graph(s) (i == L: the final graph)."""
        if i == len(self.ffns):
            self._graphs.final.replay()
            return
        g = self._graphs.layers[i]
        g.graphs[0].replay()
        if len(g.graphs) == 2:  # no external events: record between the two launches
            g.done.record()
            g.graphs[1].replay()  # the GPU computes the hot rows while the CPU computes the cold ones

    def wait_pre(self, i: int) -> None:
        """Wait on the host until layer i's `pre` has run (x and the cold mask are on the host)."""
        self._graphs.layers[i].done.synchronize()

    def replay_alone(self, i: int) -> None:
        """Layer i's graph(s) on their own (i == L: the final graph), e.g. to time them: the flag it waits for is
        released first, so no earlier launch of them may still be pending (it would take the release). Its ready
        signal stays set until the next step clears it."""
        if self.prelaunch and i > 0:
            self.flags.release(i - 1)
        self._launch(i)

    def _replay(self) -> torch.Tensor:
        """One step from the graphs. Prelaunched: layer i+1's graph is launched before the wait for layer i's (while the
        GPU runs layer i) and starts when the CPU releases flag i after the cold part; else each graph is launched
        when the previous cold part is done."""
        clock = [time.perf_counter()] if self.timing is not None else None
        tick = (lambda: clock.append(time.perf_counter())) if clock is not None else _no_tick
        L, prelaunch = len(self.ffns), self.prelaunch
        released = launched = -1  # the last flag released; the last flag a launched graph waits for
        flags = self.flags if prelaunch else None
        if prelaunch:  # signals of graphs replayed alone (replay_alone), which no cold part consumed
            flags.ready[:] = 0
        # no garbage collection while a launched graph waits on the GPU for a host flag: a collection can run the
        # finalizer that unregisters another runtime's page-locked rows (cold_rows.host_mapped), and
        # cudaHostUnregister waits for the device, which waits for this thread's flag: a deadlock
        collecting = gc.isenabled()
        gc.disable()
        try:
            for i, f in enumerate(self.ffns):
                if i == 0 or not prelaunch:
                    self._launch(i)
                if prelaunch:
                    self._launch(i + 1)
                    launched = i
                tick()
                if clock is not None or not prelaunch:  # prelaunched: cold_rows waits for the graph's signal
                    self.wait_pre(i)
                tick()
                f.cold_rows(self.x[i], flags, i)  # prelaunched: waits for ready[i], then releases flag i
                released = i if prelaunch else released
                tick()
        finally:  # an error in a cold part: let the launched graphs run out, so that the stream does not hang
            for j in range(released + 1, launched + 1):
                self.flags.release(j)
            if launched > released:  # and clear their ready signals, which no cold part will consume
                torch.cuda.synchronize(self.device)
                self.flags.ready[:] = 0
            if collecting:
                gc.enable()
        if not prelaunch:
            self._launch(L)
        if clock is not None:
            self._record(clock)
        return self._graphs.logits

    def _record(self, clock: list[float]) -> None:
        """One step's host timeline, in ms: per layer, the wait for `pre` (its GPU time, behind the previous layer's
        `hot` on the stream), split into the CPU time spent launching graphs before the sync (prelaunched: the next
        layer's, while the GPU runs this one; else this layer's) and the sync; the CPU cold part; the final graph's
        launch (not prelaunched) and GPU time after a sync."""
        torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        ms = [1e3 * (b - a) for a, b in zip(clock, clock[1:])]
        launch, sync, cold = ms[0::3], ms[1::3], ms[2::3]
        self.timing.append({"wait_pre_ms": [a + b for a, b in zip(launch, sync)], "launch_ms": launch,
                            "cold_ms": cold, "final_ms": 1e3 * (end - clock[-1]), "step_ms": 1e3 * (end - clock[0])})


def _no_tick() -> None:
    """The step's clock when no timeline is recorded."""
