"""The bottom floor: paths and URLs, checksums, file identity, durable local writes, the one
fsspec client factory (`clients`) and retrying remote reads (`retry`, `transfer`, `objects`).
"""
