"""The bench model's shapes and constants (bench_model.py builds it): light, so that pi-bench's flags read them before
torch loads."""

SHAPES = {  # d_model, n_neurons, heads, kv heads, vocab
    "llama-2-70b": (8192, 28672, 64, 8, 32000),
    "llama-3-70b": (8192, 28672, 64, 8, 128256),
    "llama-2-7b": (4096, 11008, 32, 32, 32000),
    "tiny": (128, 1536, 4, 2, 320),  # CPU tests of the harness (run them with --ctx 64)
}
CONST = 1.0  # the constant channel's value in the residual stream
EMBED_STD = 1.0  # token embeddings (channels 1..); the other weights have std `std` (bench_model's docstring)
