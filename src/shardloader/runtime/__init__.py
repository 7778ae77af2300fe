"""What a shardloader process needs from its interpreter and launcher: its place under
torch.distributed (`distenv`), whether a process is alive and still the one meant (`liveness`),
child processes that die with it (`child_process`), and the collector kept off the path to the
first batch (`startup`).
"""
