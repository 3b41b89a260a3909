"""KV cache capability model, batch ops by layer kind and KV schemes (grows with the batching issue)."""
