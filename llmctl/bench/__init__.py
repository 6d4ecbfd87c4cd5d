"""Benchmarks behind `llmctl bench`: hardware microbenchmarks, serving load generation, offline throughput/latency."""
