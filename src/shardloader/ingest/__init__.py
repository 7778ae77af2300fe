"""Making datasets: writing shards (`writer`, `shuffled`), converting existing data (`convert`),
indexing tars and Parquet in place (`indexer`), output directories (`target`), `verify`.
"""
