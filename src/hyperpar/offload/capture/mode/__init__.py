"""The dispatch mode and the online path that warmup and a diverged checked replay share,
with the regions it runs as one op."""
