"""KV cache capability model, batch ops by layer kind, KV schemes and CUDA attention routing."""
