"""Entry point of the MLflow writer process: `python -m shardloader.telemetry._mlflow_writer FD`.

Kept apart from `_mlflow_delivery` so that running it as `__main__` does not import the module
a second time. See `shardloader.telemetry._mlflow_delivery` for the protocol.
"""

from __future__ import annotations

import logging
import signal
import sys


def main() -> None:
    from multiprocessing.connection import Connection

    from shardloader.telemetry._mlflow_delivery import Delivery, serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; it closes us
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="shardloader mlflow writer: %(message)s")
    conn = Connection(int(sys.argv[1]))
    config = conn.recv()
    delivery = Delivery(**config["delivery"])
    conn.send(("ready", delivery.state()))
    serve(conn, delivery, config["flush_interval"], config["orphan_seconds"])
    conn.close()


if __name__ == "__main__":
    main()
