"""Tracing: warmup runs the step on the online path and records what every op touched."""
