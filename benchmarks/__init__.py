"""Brigade's benchmarks: `python -m benchmarks.NAME`."""
