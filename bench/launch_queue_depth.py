"""How many small kernel launches the CUDA driver queues behind a long kernel before a launch waits,
for each size of its launch queues (CUDA_SCALE_LAUNCH_QUEUES, read when a process first uses CUDA,
so each size runs in a child process of its own).

    python bench/launch_queue_depth.py [--sizes default,1x,2x,4x] [--rounds 2]      # on a GPU

A child queues a sleep kernel of about a second, then launches small kernels one by one and times
each launch; the first launch that takes over 2 ms is one the driver made wait for room. Prints JSON:
for each size, each round's launches queued before that one and the slowest launch (ms).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIABLE = "CUDA_SCALE_LAUNCH_QUEUES"
# Well past any queue size seen (a few thousand launches at 4x).
MOST_LAUNCHES = 20000
WAITED_SECONDS = 0.002
SLEEP_CYCLES = 2_000_000_000


def child(rounds: int) -> dict:
    import torch

    scratch = torch.zeros(16, device="cuda")
    scratch.add_(1)  # its kernel loaded before any timing: a first launch that loads it waits for the GPU
    torch.cuda.synchronize()
    found = []
    for _ in range(rounds):
        torch.cuda._sleep(SLEEP_CYCLES)
        slowest, queued = 0.0, MOST_LAUNCHES
        for launched in range(MOST_LAUNCHES):
            began = time.perf_counter()
            scratch.add_(1)
            took = time.perf_counter() - began
            slowest = max(slowest, took)
            if took > WAITED_SECONDS:
                queued = launched
                break
        torch.cuda.synchronize()
        found.append({"queued_before_a_wait": queued, "slowest_launch_ms": round(slowest * 1e3, 3)})
    return {"device": torch.cuda.get_device_name(), "rounds": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="default,1x,2x,4x",
                        help=f"values of {VARIABLE} (comma-separated; 'default': unset)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds)))
        return
    report = {}
    for size in args.sizes.split(","):
        environ = {key: value for key, value in os.environ.items() if key != VARIABLE}
        if size != "default":
            environ[VARIABLE] = size
        done = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds)], env=environ,
                              capture_output=True, text=True)
        report[size] = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()[-400:]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
