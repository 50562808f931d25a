"""Benchmarks that print numbers; each is runnable with `python -m colocated_grpo.bench.<name>`."""
