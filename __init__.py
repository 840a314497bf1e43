"""hotneurons: PowerInfer's ideas in Python.

Profile which FFN neurons of an LLM fire, place the hot ones on the GPU under a memory budget, train small
predictors of which neurons fire, and decode with the hot neurons on the GPU and the few active cold ones on the CPU.

The repository root is this package: `hotneurons.profiler` is ./profiler, `hotneurons.common` is ./common.
"""

__version__ = "0.2.0"
