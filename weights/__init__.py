"""Weights as stored: the formats (one table of bytes per weight), de-quantization, and sources that read a model's
tensors in place from GGUF and safetensors files."""
