"""pi-relufy: make a SwiGLU model ReLU-sparse by distillation from the original model."""
