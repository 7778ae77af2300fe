"""The pieces of the checkpoint format: state trees, tensor files, staging rounds, manifests,
and the DCP metadata reader that refuses arbitrary pickles."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardloader.checkpoint.manifest import FileEntry, Manifest, checkpoint_id, parse_id
from shardloader.checkpoint.staging import ALIGN, StagingPool, plan_rounds, pool_bytes_needed
from shardloader.checkpoint.tensorfile import (
    decode_header,
    encode_header,
    file_order,
    plan_layout,
    read_tensor_file,
)
from shardloader.checkpoint.tree import flatten, unflatten
from shardloader.errors import CheckpointError
from shardloader.io.checksum import new_hasher
from tests.fixtures.checkpoint import assert_tree_equal

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
    st.floats(allow_nan=False), st.binary(max_size=8),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.sampled_from(["__tensor__", "__dict__"]))
trees = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(trees)
def test_tree_round_trips_through_json_exactly(tree):
    skeleton, tensors, _ = flatten(tree)
    text = json.dumps(skeleton, allow_nan=False)  # strict JSON: no NaN literals, no pickle
    back = unflatten(json.loads(text), tensors, source="test")
    assert_tree_equal(tree, back)


def write_tensor_file(tensors: list[torch.Tensor]) -> bytes:
    metas = plan_layout([str(i) for i in range(len(tensors))], tensors)
    out = io.BytesIO()
    out.write(encode_header(metas))
    for i in file_order(metas):
        out.write(tensors[i].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out.getvalue()


def read_back(data: bytes) -> dict[str, torch.Tensor]:
    return read_tensor_file(io.BytesIO(data), size=len(data), hasher=new_hasher(), source="t.safetensors")


def test_tensor_file_round_trip_with_mixed_dtypes_stays_aligned():
    tensors = [torch.tensor([True, False, True]), torch.randn(3, dtype=torch.float64),
               torch.arange(5, dtype=torch.int16), torch.randn(2, 2).to(torch.bfloat16),
               torch.tensor(7, dtype=torch.int32), torch.empty(0, 4)]
    data = write_tensor_file(tensors)
    start, metas = decode_header(data, source="t", file_size=len(data))
    assert start % 8 == 0
    for m in metas:
        assert (start + m.begin) % m.itemsize == 0  # every tensor can be viewed in place
    back = read_back(data)
    for i, t in enumerate(tensors):
        assert back[str(i)].dtype == t.dtype and torch.equal(back[str(i)], t)


def test_tensor_file_is_readable_by_the_safetensors_library():
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = [torch.randn(3, 4), torch.arange(6, dtype=torch.int64)]
    loaded = safetensors.load(write_tensor_file(tensors))
    assert torch.equal(loaded["0"], tensors[0]) and torch.equal(loaded["1"], tensors[1])


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:-3], "truncated"),
    (lambda d: d + b"xx", "bytes"),
    (lambda d: (10**9).to_bytes(8, "little") + d[8:], "header length"),
    (lambda d: d.replace(b'"F32"', b'"F33"'), "unknown dtype"),
    (lambda d: d.replace(b'"data_offsets":[0,48]', b'"data_offsets":[4,52]'), "starts at byte 4"),
])
def test_damaged_tensor_files_raise_naming_the_file(damage, message):
    data = write_tensor_file([torch.randn(3, 4), torch.randn(2)])
    bad = damage(data)
    with pytest.raises(CheckpointError, match=message) as excinfo:
        read_back(bad)
    assert "t.safetensors" in str(excinfo.value)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 300), st.sampled_from([1, 2, 4, 8, 16])), min_size=1, max_size=8),
    capacity=st.integers(ALIGN, 700),
)
def test_rounds_stream_the_data_section_through_a_small_pool(sizes, capacity):
    dtypes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}
    tensors = [torch.randint(0, 100, (n,)).to(dtypes[k]) for n, k in sizes]
    metas = plan_layout([str(i) for i in range(len(tensors))], tensors)
    rounds = plan_rounds(metas, capacity)
    pool = StagingPool(cap_bytes=capacity, pin_memory=False)
    pool.reserve(capacity)
    stream = bytearray()
    for round_ in rounds:
        assert round_.nbytes <= capacity and round_.offset == len(stream)
        pool.copy_in(round_, tensors)  # views need aligned offsets: this raises otherwise
        stream += bytes(pool.view(round_))
    expected = b"".join(tensors[i].numpy().tobytes() for i in file_order(metas))
    assert bytes(stream) == expected
    single = plan_rounds(metas, pool_bytes_needed(metas))
    assert len(single) == 1


def make_manifest() -> Manifest:
    return Manifest(id=checkpoint_id(12, "0123abcd000001"), step=12, sequence=3, layout="single",
                    world_size=1, files={"state.json": FileEntry(10, "xxh3_128:" + "0" * 32)},
                    loader_fingerprint={"dataset": "abc", "seed": 1})


def test_manifest_round_trips_and_detects_any_change():
    manifest = make_manifest()
    data = manifest.to_json()
    back = Manifest.from_json(data, source="m")
    assert back.step == 12 and back.sequence == 3 and back.files == manifest.files
    assert back.loader_fingerprint == {"dataset": "abc", "seed": 1}
    body = json.loads(data)
    body["step"] = 13  # a plausible edit, still valid JSON
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        Manifest.from_json(json.dumps(body).encode(), source="m")


def test_manifest_rejects_file_names_that_escape_the_checkpoint():
    manifest = make_manifest()
    manifest.files = {"../../etc/passwd": FileEntry(1, "xxh3_128:" + "0" * 32)}
    with pytest.raises(CheckpointError, match="escapes"):
        Manifest.from_json(manifest.to_json(), source="m")


def test_checkpoint_ids_encode_the_step():
    assert parse_id(checkpoint_id(7, "deadbeef")) == 7
    assert parse_id(".staging") is None and parse_id("step-12-x") is None


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_dcp_metadata_reader_refuses_pickles_that_would_run_code(tmp_path):
    from shardloader.checkpoint.dcp_layout import SafeFileSystemReader

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
