"""Benchmark studies: named cases run for each model through the sweep launcher, plus standalone vLLM generation,
into one directory, then a results table and a figure (`python -m colocated_grpo.bench.study run|report`)."""
