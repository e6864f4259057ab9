"""Brigade past one machine: node loss and a second front, on a real multi-node Ray cluster.

The cluster is several Ray nodes on this one machine (benchmarks/harness/ray_nodes.py): a head and worker
nodes, each `ray start` with its own raylet and object store on its own loopback address
(127.0.19.x), its own role resources, Ray token auth on; `brigade serve --ray-address` joins it.
Model: the `tiny` preset, float32 (what is measured is membership and routing, which a real
model's steps would only slow down on 2 cores).

node_loss (benchmarks/harness/multinode.py): 1 prefill + 2 decode workers over nodes B and C, a
spare node D joining once serving. Under 8 live greedy requests (160 tokens each) node C is
lost: SIGKILL to its raylet, agents and workers at once.
- identical_or_retriable: requests that ended token-identical to one engine or refused as
  retriable (503) / all (target 1.0); hung: requests not ended within 240 s (target 0);
- eject_s: seconds from the loss until /health counts the lost decode worker out (target <= 5;
  /health is cached 0.5 s, polled every 50 ms);
- replaced_s: until the supervisor's replacement (on D, the node with room) is counted in;
- serving_again_s: until the first request sent after the loss was answered in full.
The full run then brings C back and loses D: `raw.node_loss.rejoined_node_used` says the
replacement landed on C.

two_fronts: 2 prefill workers (node B), 1 decode worker (node C), the owner front on the head
and a `--front-only` front on node B sharing its Redis. A shared-prefix workload (groups of
prompts with a 64-token common prefix) runs through the owner alone, then round-robin over
both fronts (fresh prompts: neither run finds the other's blocks).
- prefix_hit_vs_one_front: prefix hit ratio with two fronts / with one (target >= 0.95: the
  fronts share one index, so a prefix warmed through one front is a hit through the other);
- throughput_vs_one_front: requests/s with two fronts / one (reported; both fronts and all
  workers share 2 cores here, so this measures overhead, not scale-out).

Also writes the node-loss figures into benchmarks/results/chaos.json (key prefix node_loss.),
as the chaos suite does. Every figure is machine-load sensitive: run on a quiet machine.

--quick: 8 requests of 64 tokens for the node loss and no rejoin, a smaller front workload
(writes multinode.quick.json; a few minutes: four Ray nodes start).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _common as C

NAME = "multinode"
TARGETS = {"node_loss.identical_or_retriable": ">= 1.0", "node_loss.hung": "<= 0", "node_loss.eject_s": "<= 5",
           "two_fronts.prefix_hit_vs_one_front": ">= 0.95"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller runs, no rejoin; writes multinode.quick.json")
    parser.add_argument("--only", choices=["node_loss", "two_fronts"], help="run one part")
    args = parser.parse_args()
    import os

    os.environ.setdefault("BRIGADE_CACHE_DIR", str(Path.home() / ".cache" / "brigade"))
    from benchmarks.harness.multinode import node_loss, ratios, two_fronts
    from engine.presets import materialize

    materialize("tiny")
    start = time.monotonic()
    out_ratios: dict = {}
    raw: dict = {"model": "tiny (float32)"}
    with tempfile.TemporaryDirectory(prefix="multinode-", dir="/tmp") as tmp:
        if args.only in (None, "node_loss"):
            (Path(tmp) / "loss").mkdir()
            figures = node_loss(Path(tmp) / "loss", streams=8, max_tokens=64 if args.quick else 160,
                                rejoin=not args.quick)
            raw["node_loss"] = figures
            out_ratios.update({f"node_loss.{k}": v for k, v in ratios(figures).items()})
        if args.only in (None, "two_fronts"):
            (Path(tmp) / "fronts").mkdir()
            size = dict(groups=4, per_group=4) if args.quick else dict(groups=8, per_group=8)
            fronts = two_fronts(Path(tmp) / "fronts", **size)
            raw["two_fronts"] = fronts
            one, two = fronts["one_front"], fronts["two_fronts"]
            out_ratios["two_fronts.prefix_hit_vs_one_front"] = two["hit_ratio"] / one["hit_ratio"] \
                if one["hit_ratio"] else None
            out_ratios["two_fronts.throughput_vs_one_front"] = two["requests_per_s"] / one["requests_per_s"]
    raw["wall_s"] = time.monotonic() - start
    name = NAME + (".quick" if args.quick else "")
    targets = {k: v for k, v in TARGETS.items() if k in out_ratios}
    path = C.write_result(name, C.machine_info(quick=args.quick), out_ratios, targets, raw)
    C.print_ratios(out_ratios, targets, "multinode")
    print(f"wrote {path}")
    if "node_loss" in raw and not args.quick:
        _into_chaos(out_ratios, raw["node_loss"])
    return 0


def _into_chaos(ratios: dict, figures: dict) -> None:
    """The node-loss figures into chaos.json too, merged as the chaos suite merges its own."""
    path = C.result_path("chaos")
    old = json.loads(path.read_text()) if path.exists() else {"ratios": {}, "targets": {}, "raw": {}}
    mine = {k: v for k, v in ratios.items() if k.startswith("node_loss.")}
    C.write_result("chaos", old.get("machine") or C.machine_info(), old["ratios"] | mine,
                   old["targets"] | {k: v for k, v in TARGETS.items() if k.startswith("node_loss.")},
                   old["raw"] | {"node_loss": figures})
    print(f"node-loss figures merged into {path}")


if __name__ == "__main__":
    sys.exit(main())
