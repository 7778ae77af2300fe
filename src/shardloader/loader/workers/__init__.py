"""Worker pools: processes (or threads) that run batch tasks and hand batches back in order,
through reused shared-memory slots."""
