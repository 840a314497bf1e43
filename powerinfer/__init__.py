"""PowerInfer in Python: activation profiling, neuron placement, predictors and a hybrid CPU/GPU runtime."""

__version__ = "0.1.0"
