"""The model on the worker: weights loading, the Llama-family forward, the paged KV cache and attention."""
