"""Benchmark workloads and runners (``kvoffload bench``)."""
