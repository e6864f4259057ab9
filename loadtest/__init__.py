"""`brigade bench`: load generation against Brigade (gRPC SDK) or any OpenAI-compatible HTTP server.

workloads/ make sessions (one or more turns), arrivals.py says when each session starts,
runner.py drives a Target with them, metrics.py turns the per-request records into the
summary, report.py / plots.py / compare.py write and read the results.
"""
