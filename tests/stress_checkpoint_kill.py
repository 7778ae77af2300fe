"""Stress version of the kill test (not collected by pytest; run it by hand):

    .venv/bin/python tests/stress_checkpoint_kill.py --kills 40

Kills a training child with SIGKILL at random instants in every save phase (stage, write,
upload, commit, retention; staging renamed into place and copied across file systems), and
after each kill checks that the newest complete checkpoint verifies and restores exactly the
state of an uninterrupted run at that step. Prints one line per kill and a summary; exits 1 on
the first failure.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fixtures.checkpoint import KILL_PHASES, kill_cycle, verify_after_kill  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=40)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--big", type=int, default=1 << 20, help="floats in the model's buffer")
    parser.add_argument("--max-delay", type=float, default=0.01, help="seconds after the event")
    args = parser.parse_args()
    draw = random.Random(args.seed)
    print(f"seed {args.seed}, {args.kills} kills, state ~{args.big * 4 >> 20} MiB")
    counts: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(
        dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    ) as other_device:
        root = os.path.join(work, "root")
        stagings = [None, other_device]
        for i in range(args.kills):
            phase = KILL_PHASES[i % len(KILL_PHASES)]
            staging = stagings[(i // len(KILL_PHASES)) % 2]
            report = kill_cycle(root, staging, phase=phase, occurrence=draw.randint(1, 4),
                                delay=draw.uniform(0, args.max_delay), big=args.big)
            try:
                assert report["rc"] == -9, f"child was not killed: {report}"
                step = verify_after_kill(root, staging, report, args.big)
            except AssertionError as exc:
                print(f"FAIL kill {i}: {exc}")
                return 1
            died_in = report["died_in"].split()[0] if report["died_in"] else "?"
            counts[died_in] += 1
            print(f"kill {i:3d}  after {phase:9s} +{report['delay'] * 1e3:5.2f} ms  "
                  f"died in {report['died_in']:16s}  staging {'copy  ' if staging else 'rename'}  "
                  f"committed {report['committed']:4d}  latest {step:4d}  ok", flush=True)
    print(f"all {args.kills} kills ok; phase the child was in when killed: {dict(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
