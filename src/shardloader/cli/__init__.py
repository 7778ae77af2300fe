"""The `shardloader` command line: one module per subcommand, on top of every other package.
"""
