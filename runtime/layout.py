"""The old import path of `Placement` (now runtime/placement.py), kept for bench/pi_bench.py and
bench/cold_int8_quality.py until they import it from there; delete this module then."""

from hotneurons.runtime.placement import Placement

__all__ = ["Placement"]
