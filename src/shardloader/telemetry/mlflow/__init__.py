"""The MLflow transport of telemetry: the `MLflowLogger` sink and what delivers its metrics.

`logger` (the sink, on the training side), `transport` (delivery in its background thread or
in a writer process), `delivery` (every MLflow call), `writer` (the writer process's entry
point), `probe` (is the tracking server answering) and `owner` (is a run's trainer alive).
`shardloader.telemetry.MLflowLogger` is the public name.
"""
