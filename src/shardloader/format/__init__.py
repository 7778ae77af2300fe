"""Shard formats only: the index, field types, and for each format (Arrow IPC, WebDataset tar,
Parquet) its reader, range table and rows by byte range, chosen through `registry`.
"""
