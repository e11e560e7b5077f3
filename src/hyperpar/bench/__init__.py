"""Benchmarks run by ``hyperpar bench``; results go to benchmarks/results/*.json."""
