"""The node's shard cache on local disk: store, room and eviction, ledger, kernel-held locks,
reconcile, capacity, pressure between processes, and background prefetch.
"""
