"""Benchmarks run by ``hyperpar bench``; JSON goes to ``./hyperpar-bench/`` unless ``--out`` is given."""
