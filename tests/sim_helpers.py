"""What the co-run tests simulate on (tests/unit/test_sim_corun.py, test_sim_corun_joint.py)."""
from __future__ import annotations

from sim.corun import HitScene
from sim.hardware import load_device

# About the 2-core Zen3's speed in float32: steps of tens of ms, as measured
CORUN_HOST = load_device("cpu-2core").model_copy(update={
    "name": "host", "host_cores": 2.0, "stream_cpu_s": 0.004, "peak_flops": 6e10, "mem_bw": 1e11,
    "step_overhead_s": 0.017, "seq_overhead_s": 0.002})
# Short and long hits; the stream outlasts them
CORUN_SCENE = HitScene("bench", width=1, hits=12, stream_len=400, cold=False)
