"""The format registry (shardloader.format.registry): one declared description per shard format,
its code loaded only when used, and a clear error for a format it does not know."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardloader.format.index import ShardInfo
from shardloader.format.protocol import FormatCode
from shardloader.format.registry import FORMATS, open_shard, shard_format
from shardloader.format.tar import OFFSETS_KEY, SIDECAR_SUFFIX


def test_every_format_declares_its_code():
    assert list(FORMATS) == ["arrow", "tar", "parquet"]
    for name, fmt in FORMATS.items():
        assert fmt.name == name and fmt.suffix == f".{name}"
        code = fmt.load()
        assert isinstance(code, FormatCode)
        assert (code.decode_companion is None) == (fmt.companion is None)


def test_the_tar_companion_is_the_sidecar_its_reader_reads():
    companion = FORMATS["tar"].companion
    assert companion is not None
    assert (companion.key, companion.suffix) == (OFFSETS_KEY, SIDECAR_SUFFIX)


def test_an_unknown_format_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"^x\.zip: unknown shard format 'zip' \(known: arrow, tar, parquet\)$"):
        shard_format("zip", where="x.zip")
    with pytest.raises(ValueError, match=r"unknown shard format \['arrow'\]"):
        shard_format(["arrow"])
    info = ShardInfo("a.zip", "zip", 1, 1, "xxh3_128:" + "0" * 32)
    with pytest.raises(ValueError, match=r"^a\.zip: unknown shard format 'zip'"):
        open_shard(info, "/nonexistent/a.zip")


def test_naming_the_formats_loads_none_of_their_code():
    """Validating an index and naming cache files ask the registry; its formats' code (and
    pyarrow, which Parquet's code imports) is loaded only when a shard is read."""
    code = (
        "import json, sys\n"
        "import shardloader.cache.layout, shardloader.format.index, shardloader.format.roots\n"
        "heavy = ['shardloader.format.' + m for m in ('arrow', 'arrow_ranges', 'tar', 'parquet')]\n"
        "print(json.dumps([m for m in heavy + ['pyarrow'] if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
