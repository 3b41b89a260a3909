"""Load benchmarks over live HTTP/SSE: load generator, metrics, datasets, sweeps and reports."""
