"""Model definitions, one per family: each owns its weights and its static KV cache, fed tensor by tensor from a
weight source (hotneurons.weights). The engine (hotneurons.runtime) runs them; transformers is only their reference."""
