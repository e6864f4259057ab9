"""What every benchmark shares: `run` (a benchmark's frame: plan, timed phases, ratios against
targets, the JSON result and its plot), `served` (a real `brigade serve` as a context), `cpu`
(who used the CPUs while a phase ran), and the multi-node Ray fleet the node-loss figures need.
"""
