"""The MLflow transport of telemetry: the `MLflowLogger` sink and what delivers its metrics.

`logger` (the sink, on the training side), `transport` (delivery in its background thread or
in a writer process), `delivery` (every MLflow call), `writer` (the writer process's entry
point), `probe` (is the tracking server answering) and `owner` (is a run's trainer alive).
`shardloader.telemetry.MLflowLogger` is the public name.

The writer process (`process=True`, the default) against MLflow's client in a thread of the
training process (`process=False`), measured for issue 37 with `benchmarks/telemetry_overhead.py
--server` (a real `mlflow server` on 127.0.0.1, sqlite backend; 2 workers, batch 64, 12
metrics a batch, 5 repeats, medians; 2 cores shared with other engineers' jobs, load 1.4-6):

| step | samples/s vs telemetry off: process / thread (best runs) | training-process CPU a batch: off / process / thread |
|-|-|-|
| 5 ms | 0.972 / 0.937 (1.002 / 0.998) | 421 / 504 / 441 us |
| 50 ms | 1.000 / 0.999 (0.999 / 1.000) | 728 / 703 / 2,714 us |

At a realistic 50 ms step neither costs throughput a user would see (within 0.1% of off); the
thread's cost is CPU in the training process, ~2 ms a batch (one `log_batch` request per
flush: ~220 us of CPU a record), which a step holding the GIL would share. So the writer
process earns its place only at very short steps (5 ms: 0.937 against 0.972 of off, medians of
a noisy machine). Recommendation (not done here): the thread as the default and the writer
process removed or kept opt-in, once measured on a training step that holds the GIL. Seen in
the same runs: the writer process twice failed to deliver the 768 metrics still queued at its close within
`close(timeout=10)` on the loaded machine (killed, counted as not delivered); the thread never.
"""
