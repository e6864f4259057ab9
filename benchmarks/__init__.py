"""Brigade's measurements, one package: each `*_bench` module is a benchmark
(`python -m benchmarks.engine_bench --quick`), built on `benchmarks.harness` (plan -> phases ->
ratios -> JSON -> plot, the served fleet, CPU accounting). Modules starting with `_` are pieces of
one benchmark, not benchmarks themselves (`make bench` skips them). The tests that drive a real
`brigade serve` from outside use the same served-fleet harness (tests/serve_process.py).
"""
