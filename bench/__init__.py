"""Benchmarks of ddpk against the obvious alternatives, measured side by side (`make bench`)."""
