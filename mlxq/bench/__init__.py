"""Load benchmarks over HTTP (grows with the bench issue)."""
