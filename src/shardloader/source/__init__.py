"""Where a dataset's shard bytes come from, behind one protocol (`protocol.ShardSource`): the
local directory read in place (`local`), or a remote URL through the node cache (`remote`, with
rows read by byte range in `ranged`); and reading `index.json` (`index`).
"""
