"""Activation profiler: `pi-profile` (counts which FFN neurons fire, stores predictor training samples)."""
