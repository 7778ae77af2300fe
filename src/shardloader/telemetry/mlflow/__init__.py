"""The MLflow transport of telemetry: the `MLflowLogger` sink and what delivers its metrics.

`logger` (the sink: a bounded queue on the training thread, one daemon thread behind it),
`delivery` (every MLflow call, made with MLflow's own `MlflowClient` on that thread), `bounded`
(each request to a tracking server under a timeout, no MLflow retries), `probe` (is the
tracking server answering), `owner` (is a run's trainer alive) and `jobruns` (the job's parent
run). `shardloader.telemetry.MLflowLogger` is the public name.

Why no writer process (issue 37). Until then the default delivered from a separate writer
process over a socket protocol (~270 lines: transport, writer, the protocol and its loop), to
keep MLflow's per-metric CPU (20-70 us) off the training process's GIL. Measured against
MLflow's client in a thread of the training process with `benchmarks/telemetry_overhead.py
--server` (a real `mlflow server` on 127.0.0.1, sqlite backend; 2 workers, batch 64, 12 metrics
a batch, 5 repeats, medians; 2 cores shared with other engineers' jobs, load 1.4-6):

| step | samples/s vs telemetry off: process / thread (best runs) | training-process CPU a batch: off / process / thread |
|-|-|-|
| 5 ms | 0.972 / 0.937 (1.002 / 0.998) | 421 / 504 / 441 us |
| 50 ms | 1.000 / 0.999 (0.999 / 1.000) | 728 / 703 / 2,714 us |

At a realistic step (50 ms and longer) neither costs throughput a user would see (within 0.1%
of off): the thread's ~2 ms of CPU a batch (one `log_batch` request per flush) fits in the
step. Only at a 5 ms step did the process help, and in the same runs the writer process twice
failed to deliver the 768 metrics still queued at its close within `close(timeout=10)` (killed,
counted as not delivered); the thread never did. So the process did not earn its place and
went; `MLflowLogger(process=...)` is accepted and ignored.

After the change (the same command, quiet machine, load 0.3-2.7): at 5 ms 1.009 of off, at
50 ms 1.000 (medians). Most of the thread's 2 ms of CPU a batch at 50 ms was not MLflow but
the liveness probe building a TLS context (49 ms of CPU: it loads the CA bundle) before every
flush, even for http; built once, https only, the thread costs 1,444 against 852 us a batch
with telemetry off (was 3,287 against 918 in the same setting).
"""
