"""Job accounting: what every attempt of a training job spent its time and bytes on.

A job is every attempt (launch) that trains into one checkpoint root. `recorder` writes each
rank's records as it trains (the `Checkpointer` opens the attempt; the training `Loader` and
the checkpointer report to it); `read` reads them back, `account` turns them into the job's
account (seconds that add up to its wall time, goodput, samples trained twice or never, bytes),
`prices` into money, and `render` into text and a timeline plot
(`shardloader report --job CHECKPOINT_DIR`).

Submodules are imported where needed: the training process imports only `recorder`.
"""
