"""Entry point of the MLflow writer process:
`python -m shardloader.telemetry.mlflow.writer FD PARENT_PID`.

Kept apart from `delivery` so that running it as `__main__` does not import the module
a second time. See `shardloader.telemetry.mlflow.delivery` for the protocol. The process dies
with the training process that started it (`die_with_parent`, armed before anything else):
when the trainer is killed, nobody is left to close the run, and the next logger in the same
experiment marks it FAILED (see `shardloader.telemetry.mlflow.owner`).
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    from shardloader.runtime.child_process import die_with_parent

    # The logger starts us from its background thread, which lives until we have finished:
    # the parent-death signal (tied to that thread) is safe here.
    die_with_parent(int(sys.argv[2]), use_signal=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; it closes us

    import logging
    from multiprocessing.connection import Connection

    from shardloader.telemetry.mlflow.delivery import Delivery, serve

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="shardloader mlflow writer: %(message)s")
    conn = Connection(int(sys.argv[1]))
    config = conn.recv()
    delivery = Delivery(**config["delivery"])
    conn.send(("ready", delivery.state()))
    serve(conn, delivery, config["flush_interval"])
    conn.close()


if __name__ == "__main__":
    main()
