"""shardloader against peer loaders end to end: throughput, first batch, resume cost and
exactness, and stalls under a realistic consumer.

Same JPEGs (`benchmarks/_images.py`), same work per sample (shardloader's `DecodeCropFlip` to
112 px, so that differences are the loaders', not the decoders'), batch 64, 2 workers:

* shardloader `Loader` (Arrow shards; process workers, the default),
* torch `DataLoader` over the image files (map-style, shuffled by a seeded generator),
* torchdata `StatefulDataLoader` (the same, with DataLoader's resumable state),
* webdataset `WebLoader` over tar shards (deterministic shard shuffle and a seeded buffer),
* mosaicml-streaming `StreamingDataset` + `StreamingDataLoader` (MDS shards),
* litdata `StreamingDataset` + `StreamingDataLoader` (litdata's chunks),
* FFCV, where installed (its .beton file; RandomResizedCrop + flip in its own pipeline),
* SPDL, where installed (`spdl_peer`: its thread pipeline over the image files, decoding with
  its own FFmpeg-based decoder; in this process, or in a subprocess as its docs describe).

Optional peers that are not installed print "not installed" rows; they live in a separate venv
(they pin versions the main one must not take), which `make bench-setup` builds (FFCV too where
`apt-get install -y libturbojpeg0-dev libopencv-dev pkg-config` has been done):

    make bench-setup
    .venv-bench/bin/python -m benchmarks.peers          # about 4 minutes on 2 cores

The adapters below also serve `benchmarks/speed.py` (issue 14's table): each takes the per-sample
`work` ("fast": DecodeCropFlip; "pil": the PIL transform of benchmarks/throughput.py), and the
ones that can read S3 take a `Remote` (an S3 endpoint and an empty cache folder).

mosaicml-streaming imports torchvision (for its vision datasets, unused here); PyPI's torchvision
wheels are CUDA builds that do not load against the CPU torch, so `import_streaming` stubs that
subpackage when torchvision does not load.

Four phases:

1. First batch: a fresh loader, from construction to the first batch; it then runs its whole
   first epoch, whose sample ids are the reference sequence.
2. Throughput: `--rounds` more epochs of each loader, the loaders taking turns epoch by epoch
   so that load from other processes hits them alike; samples/s after each epoch's first 5
   batches, median over the rounds.
3. Resume: a fresh loader runs 40% of the epoch and its state is taken (peers with no state:
   the number of batches consumed); a new loader restores it and finishes the epoch. Resume
   cost = from the restore call to the first batch after it; exact = the ids of the two
   parts, concatenated, equal the reference sequence element for element (not as sets).
   A peer without resumable state can only replay: iterate again from the start and skip
   (decoding) the consumed batches; that is measured as its resume cost.
4. Stalls: a consumer that works (sleeps) 1.25x the per-batch time the loader sustained
   (80% of its capacity) for `--stall-batches` batches, the loaders taking turns in chunks of
   20 batches; stall fraction = time waiting in next() / wall time. A loader that keeps up
   scores near 0; what remains is the work the loader does inside next() on the training
   thread.

FFCV reference (the issue): 6,900 samples/s with 2 workers on this work, 5-11 s to its first
batch. The machine is shared: figures move with other processes' load (printed).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from benchmarks._common import emit, load_average, machine, spread, table
from benchmarks._images import ImageSet, describe, prepare_images

SIZE = 112
BATCH = 64
WORKERS = 2
SEED = 17
RESUME_FRACTION = 0.4
WARMUP_BATCHES = 5
FFCV_MARK = 6_900.0


WORKS = {
    "fast": f"DecodeCropFlip({SIZE}) (simplejpeg + cv2, antialiased: shardloader's fast path)",
    "pil": "PIL decode + RandomResizedCrop + flip, torchvision-style (what peers' users write)",
}
#: Works of the sample-dict loaders only (shardloader's Loader, and for "own" the DataLoader):
#: the README's transform, and the same two transforms inside a user's own function.
DICT_WORKS = {
    "readme": f"Compose([DecodeCropFlip({SIZE}), ToTensor()]) (the README's transform)",
    "own": f"the same DecodeCropFlip({SIZE}) + ToTensor() inside the user's own function, "
           "returning {'img': t, 'label': l}",
}


def loader_transform(work: str) -> Any:
    """The per-sample work as shardloader's Loader takes it (a sample-dict transform)."""
    if work == "pil":
        from benchmarks.throughput import pil_sample_transform

        return pil_sample_transform
    if work == "own":
        return own_transform
    from shardloader.transforms import Compose, DecodeCropFlip, ToTensor

    if work == "readme":
        return Compose([DecodeCropFlip(SIZE), ToTensor()])
    return DecodeCropFlip(SIZE)


_OWN: tuple[Any, Any] | None = None  # (DecodeCropFlip(SIZE), ToTensor()), built on first use


def own_transform(sample: dict[str, Any], generator: Any = None) -> dict[str, Any]:
    """What a user writes around the built-in transforms: the README's two transforms applied
    by hand to `sample["image"]`, returning only `{"img": CHW uint8 tensor, "label": ...}`.

    It asks for `generator` by name and hands it to `DecodeCropFlip`, as `Compose` does, so its
    pixels are those of the README transform for the same (seed, epoch, sample) key. A plain
    function, so the Loader treats it as any user code (it may draw from the global RNGs)."""
    global _OWN
    if _OWN is None:
        from shardloader.transforms import DecodeCropFlip, ToTensor

        _OWN = (DecodeCropFlip(SIZE), ToTensor())
    crop, tensor = _OWN
    image = tensor(crop(sample, generator=generator))["image"]
    return {"img": image, "label": sample["label"]}


class Augment:
    """The same work on raw JPEG bytes, for the peers' pipelines: `bytes -> HWC uint8`, drawing
    from the global torch RNG, as peers' per-sample transforms do."""

    def __init__(self, work: str = "fast") -> None:
        if work not in WORKS:
            raise ValueError(f"unknown work {work!r}; known: {', '.join(WORKS)}")
        self.work = work
        self.t = None if work == "pil" else loader_transform(work)

    def __call__(self, data: bytes) -> np.ndarray:
        if self.t is None:
            from benchmarks.throughput import pil_crop_flip

            return pil_crop_flip(data)
        return self.t({"image": data})["image"]


@dataclass(frozen=True)
class Remote:
    """Where a peer reads its dataset from when not from local files: an S3 endpoint holding
    each layout under s3://<bucket>/<layout> (see benchmarks/_s3.py), and a fresh, empty local
    cache folder for this loader (a cold start)."""

    s3: Any  # a benchmarks._s3.S3Endpoint
    cache_dir: str


# -- the peers ---------------------------------------------------------------------------------
# Each adapter: `make()` returns a loader handle with iteration over batches, `ids(batch)`,
# `state(handle, consumed_batches)` after some batches, `restore(state)` -> a fresh handle set
# to continue, and `close(handle)`. `resumable` says whether state is real or replay.


@dataclass
class Peer:
    name: str
    fmt: str
    make: Callable[[], Any]
    ids: Callable[[Any], list[int]]
    state: Callable[[Any, int], Any]
    restore: Callable[[Any], Any]
    close: Callable[[Any], None]
    resumable: bool
    note: str = ""


@dataclass
class Result:
    name: str
    fmt: str
    status: str = "ok"
    ttfb: float = float("nan")
    rate: float = float("nan")
    resume_kind: str = "-"
    resume_seconds: float = float("nan")
    exact: str = "-"
    mismatch: str = ""
    stall: float = float("nan")
    rates: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Replay:
    """Resume by replay: a fresh loader that skips (still producing) `skip` batches."""

    def __init__(self, handle: Any, skip: int) -> None:
        self.handle, self.skip = handle, skip

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.handle)
        for _ in range(self.skip):
            next(it)
        return it


def shardloader_peer(images: ImageSet, work: str = "fast", remote: Remote | None = None) -> Peer:
    from shardloader import Dataset, Loader

    def dataset() -> Any:
        if remote is None:
            return Dataset(images.arrow_dir)
        return Dataset(remote.s3.url("arrow"), cache_dir=remote.cache_dir,
                       storage_options=remote.s3.fsspec_options())

    def make() -> Any:
        # tail="partial": the last batch is short, as in the peers (the default pads it)
        return Loader(dataset(), batch_size=BATCH, num_workers=WORKERS,
                      transform=loader_transform(work), seed=SEED, tail="partial", shuffle=True,
                      persistent_workers=True)

    def restore(state: Any) -> Any:
        loader = make()
        loader.load_state_dict(state)
        return loader

    return Peer("shardloader Loader", "Arrow", make, lambda b: b["__index__"].tolist(),
                lambda h, k: h.state_dict(), restore, lambda h: h.close(), True)


class FileDataset(torch.utils.data.Dataset):
    """Map-style dataset over image files: (image, id); with work "own", the user's function's
    dict `{"img", "label"}` plus the id as `__index__` (as shardloader's batches carry it)."""

    def __init__(self, images: ImageSet, work: str = "fast") -> None:
        self.items = images.file_items()
        self.own = work == "own"
        self.t = None if self.own else Augment(work)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        path, label = self.items[i]
        with open(path, "rb") as f:
            data = f.read()
        if self.own:
            return {**own_transform({"image": data, "label": label}), "__index__": i}
        assert self.t is not None
        return torch.from_numpy(self.t(data)), i


def _shutdown(handle: Any) -> None:
    it = getattr(handle, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    gc.collect()


def dataloader_peer(images: ImageSet, work: str = "fast") -> Peer:
    def make() -> Any:
        return torch.utils.data.DataLoader(
            FileDataset(images, work), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
            generator=torch.Generator().manual_seed(SEED), persistent_workers=True)

    ids = (lambda b: b["__index__"].tolist()) if work == "own" else (lambda b: b[1].tolist())
    return Peer("torch DataLoader", "files", make, ids,
                lambda h, k: k, lambda k: _Replay(make(), k),
                lambda h: _shutdown(h.handle if isinstance(h, _Replay) else h), False,
                "no resumable state: resume replays the consumed batches")


def stateful_peer(images: ImageSet) -> Peer:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> Any:
        return StatefulDataLoader(
            FileDataset(images), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
            generator=torch.Generator().manual_seed(SEED), persistent_workers=True)

    def restore(state: Any) -> Any:
        loader = make()
        loader.load_state_dict(state)
        return loader

    return Peer("torchdata StatefulDataLoader", "files", make, lambda b: b[1].tolist(),
                lambda h, k: h.state_dict(), restore, _shutdown, True)


def webdataset_peer(images: ImageSet) -> Peer:
    import webdataset as wds

    urls = images.tar_urls()
    t = Augment()

    def sample(s: tuple[str, bytes]) -> tuple[np.ndarray, int]:
        return t(s[1]), int(s[0])

    def make() -> Any:
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), detshuffle=True, seed=SEED,
                             empty_check=False)
              .shuffle(1000, seed=SEED)
              .to_tuple("__key__", "jpg")
              .map(sample)
              .batched(BATCH, partial=True))
        return wds.WebLoader(ds, batch_size=None, num_workers=WORKERS, persistent_workers=True)

    return Peer("webdataset WebLoader", "tar", make, lambda b: list(map(int, b[1])),
                lambda h, k: k, lambda k: _Replay(make(), k),
                lambda h: _shutdown(h.handle if isinstance(h, _Replay) else h), False,
                "no resumable state: resume replays the consumed batches")


def import_streaming() -> Any:
    """mosaicml-streaming, importable without torchvision.

    `import streaming` imports its `streaming.vision` subpackage, which needs torchvision; PyPI
    has only CUDA builds of torchvision, which cannot load against the CPU torch that
    constraints.txt pins (libtorch_cuda.so missing). We use none of streaming.vision, so when
    torchvision does not load, an empty module stands in for that subpackage.
    """
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError or the RuntimeError of a mismatched build
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def mosaic_peer(images: ImageSet, work: str = "fast", remote: Remote | None = None) -> Peer:
    """mosaicml-streaming; from S3 when `remote` is given (it reads the endpoint and the
    credentials from the environment: set `remote.s3.env()` before calling `make`)."""
    streaming = import_streaming()
    from streaming import StreamingDataLoader, StreamingDataset

    from benchmarks._images import prepare_mds

    where = ({"local": prepare_mds(images)} if remote is None
             else {"remote": remote.s3.url("mds"), "local": remote.cache_dir})

    class MDSImages(StreamingDataset):
        def __init__(self) -> None:
            super().__init__(**where, shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
            self.t = Augment(work)

        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
            s = super().__getitem__(i)
            return self.t(s["jpg"]), int(s["id"])

    def make() -> Any:
        streaming.base.util.clean_stale_shared_memory()
        return StreamingDataLoader(MDSImages(), batch_size=BATCH, num_workers=WORKERS,
                                   persistent_workers=True)

    def restore(state: Any) -> Any:
        loader = make()
        loader.load_state_dict(state)
        return loader

    return Peer("mosaicml-streaming", "MDS", make, lambda b: b[1].tolist(),
                lambda h, k: h.state_dict(), restore, _shutdown, True)


def litdata_peer(images: ImageSet, work: str = "fast", remote: Remote | None = None) -> Peer:
    """litdata; from S3 when `remote` is given (endpoint and credentials through its
    `storage_options`, which go to its boto3 client and the obstore store built from it)."""
    import litdata

    from benchmarks._images import prepare_litdata

    where = ({"input_dir": prepare_litdata(images)} if remote is None
             else {"input_dir": remote.s3.url("litdata"), "cache_dir": remote.cache_dir,
                   "storage_options": remote.s3.boto_options()})
    if remote is not None and remote.s3.endpoint.startswith("http://"):
        # litdata fetches chunks with obstore, whose client refuses plain http unless told
        # (a real S3 endpoint is https); storage_options reach only boto3, so the loopback
        # server is allowed in litdata's obstore client options (inherited by forked workers).
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"

    class LitImages(litdata.StreamingDataset):
        def __init__(self) -> None:
            super().__init__(**where, shuffle=True, seed=SEED)
            self.t = Augment(work)

        def __getitem__(self, index: Any) -> tuple[np.ndarray, int]:
            s = super().__getitem__(index)
            return self.t(s["jpg"]), int(s["id"])

    def make() -> Any:
        return litdata.StreamingDataLoader(LitImages(), batch_size=BATCH, num_workers=WORKERS,
                                           persistent_workers=True)

    def restore(state: Any) -> Any:
        loader = make()
        loader.load_state_dict(state)
        return loader

    return Peer("litdata", "litdata chunks", make, lambda b: b[1].tolist(),
                lambda h, k: h.state_dict(), restore, _shutdown, True)


def ffcv_peer(images: ImageSet) -> Peer:
    from benchmarks._ffcv import ffcv_loader, prepare_beton

    path = prepare_beton(images)

    def make() -> Any:
        return ffcv_loader(path, BATCH, WORKERS, SEED, SIZE)

    return Peer("FFCV", "beton", make, lambda b: b[1].reshape(-1).tolist(),
                lambda h, k: k, lambda k: _Replay(make(), k), lambda h: None, False,
                "no resumable state: resume replays the consumed batches")


def import_spdl() -> Any:
    """`spdl.io` with its native library loaded: the import alone succeeds without FFmpeg, whose
    shared libraries (libavutil & co., 4.x-8.x; apt: libavfilter8 libavformat59 libavdevice59
    on Debian 12) the first decode then fails to find. One tiny JPEG is demuxed and decoded to
    find out here, with the reason in the error."""
    import simplejpeg
    import spdl.io
    import spdl.pipeline  # noqa: F401

    tiny = simplejpeg.encode_jpeg(np.zeros((8, 8, 3), np.uint8))
    spdl.io.decode_packets(spdl.io.demux_image(tiny), filter_desc=_SPDL_RGB)
    return spdl.io


# SPDL's image pipeline (its docs' `spdl.dataloader.DataLoader` example and its ImageNet
# example): a source of file paths, a per-image stage that demuxes and decodes with an FFmpeg
# filter graph (here: crop, scale to SIZE, flip, RGB), run concurrently on the pipeline's
# threads (FFmpeg releases the GIL), then `aggregate` into batches of BATCH and
# `convert_frames` merging the frames into one NHWC uint8 buffer. Its filters take a crop box,
# not a random crop: the box and the flip are drawn as RandomResizedCrop(SIZE) + flip draw them
# (`sample_crop_box_and_flip`, from a generator keyed per sample and epoch), for the image size
# the demuxer reports. Bicubic scaling (its filters' default) where the others do an
# antialiased area resize.

_SPDL_RGB = "format=pix_fmts=rgb24"


class SpdlSource:
    """The pipeline's source: (path, label, id, crop seed) of every image, in an order shuffled
    per epoch (seeded); each `iter()` is the next epoch, so one object serves every epoch, in
    this process or in SPDL's subprocess (it is pickled there)."""

    def __init__(self, items: list[tuple[str, int]], seed: int) -> None:
        self.items, self.seed, self.epoch = items, seed, 0

    def __iter__(self) -> Iterator[tuple[str, int, int, int]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        order = np.random.default_rng((self.seed, epoch)).permutation(len(self.items))
        base = (self.seed * 1_000_003 + epoch) * (len(self.items) + 1)
        for i in order.tolist():
            path, label = self.items[i]
            yield path, label, i, base + i


def spdl_decode(item: tuple[str, int, int, int]) -> tuple[Any, int, int]:
    """One image: demux, draw its crop box and flip, decode through that filter graph."""
    import spdl.io

    from shardloader.transforms.geometry import sample_crop_box_and_flip

    path, label, index, key = item
    packets = spdl.io.demux_image(path)
    generator = torch.Generator().manual_seed(key)
    (top, left, height, width), flip = sample_crop_box_and_flip(
        packets.height, packets.width, (0.08, 1.0), (3 / 4, 4 / 3), 0.5, generator)
    graph = (f"crop={width}:{height}:{left}:{top},scale={SIZE}:{SIZE}:flags=bicubic"
             + (",hflip" if flip else "") + "," + _SPDL_RGB)
    return spdl.io.decode_packets(packets, filter_desc=graph), label, index


def spdl_batch(items: list[tuple[Any, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch: the frames merged into one (N, SIZE, SIZE, 3) uint8 tensor, labels, ids."""
    import spdl.io

    images = spdl.io.to_torch(spdl.io.convert_frames([frames for frames, _, _ in items]))
    return (images, torch.tensor([label for _, label, _ in items]),
            torch.tensor([index for _, _, index in items]))


def spdl_config(images: ImageSet, threads: int = WORKERS) -> Any:
    """The pipeline's definition (a PipelineConfig: picklable, built per epoch)."""
    from spdl.pipeline import PipelineBuilder

    return (PipelineBuilder()
            .add_source(SpdlSource(images.file_items(), SEED))
            .pipe(spdl_decode, concurrency=threads)
            .aggregate(BATCH)
            .pipe(spdl_batch)
            .add_sink(3)
            .get_config())


class SpdlThreads:
    """SPDL in the training process: each `iter()` builds the pipeline from the config (its
    threads start) and runs one epoch, stopping the pipeline at its end or when abandoned."""

    def __init__(self, config: Any, threads: int) -> None:
        self.config, self.threads = config, threads

    def __iter__(self) -> Iterator[Any]:
        from spdl.pipeline import build_pipeline

        pipeline = build_pipeline(self.config, num_threads=self.threads)
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()


def spdl_peer(images: ImageSet, subprocess: bool = False) -> Peer:
    """SPDL with WORKERS decode threads; `subprocess`: the pipeline runs in one subprocess
    (`run_pipeline_in_subprocess`, created once and iterated once per epoch, batches coming
    back through its queue), else on threads of this process."""
    import_spdl()
    from spdl.pipeline import run_pipeline_in_subprocess

    def make() -> Any:
        config = spdl_config(images)
        if subprocess:
            return run_pipeline_in_subprocess(config, num_threads=WORKERS)
        return SpdlThreads(config, WORKERS)

    def close(handle: Any) -> None:
        handle = handle.handle if isinstance(handle, _Replay) else handle
        shutdown = getattr(handle, "_shutdown", None)  # the subprocess's: stop it now
        if shutdown is not None:
            shutdown()
        gc.collect()

    return Peer("SPDL subprocess" if subprocess else "SPDL", "files", make,
                lambda b: b[2].tolist(), lambda h, k: k, lambda k: _Replay(make(), k), close,
                False, "no resumable state: resume replays the consumed batches")


PEERS: list[tuple[str, Callable[[ImageSet], Peer], str]] = [
    ("shardloader Loader", shardloader_peer, "shardloader"),
    ("torch DataLoader", dataloader_peer, "torch"),
    ("torchdata StatefulDataLoader", stateful_peer, "torchdata"),
    ("webdataset WebLoader", webdataset_peer, "webdataset"),
    ("mosaicml-streaming", mosaic_peer, "streaming"),
    ("litdata", litdata_peer, "litdata"),
    ("FFCV", ffcv_peer, "ffcv"),
    ("SPDL", spdl_peer, "spdl"),
    ("SPDL subprocess", lambda images: spdl_peer(images, subprocess=True), "spdl"),
]


# -- measuring ---------------------------------------------------------------------------------


def first_epoch(peer: Peer, result: Result, n: int, log: Callable[[str], None]) -> tuple[Any, list[int]]:
    """Time to first batch of a fresh loader, then its whole first epoch: the reference id
    sequence. Returns the loader (kept for the throughput rounds) and the sequence."""
    start = time.perf_counter()
    loader = peer.make()
    it = iter(loader)
    batch = next(it)
    result.ttfb = time.perf_counter() - start
    reference = list(peer.ids(batch))
    for batch in it:
        reference += peer.ids(batch)
    del it, batch
    log(f"  {peer.name}: first batch {result.ttfb:.2f} s, {len(reference)} samples in the epoch")
    if sorted(reference) != list(range(n)):
        result.notes.append(f"an epoch is not each sample once ({len(reference)} samples, "
                            f"{len(set(reference))} distinct)")
    return loader, reference


def epoch_rate(peer: Peer, loader: Any) -> float:
    """Samples/s of one more epoch of a warm loader, after its first WARMUP_BATCHES batches."""
    count, t_warm = 0, time.perf_counter()
    for i, batch in enumerate(loader):
        if i == WARMUP_BATCHES:
            t_warm, count = time.perf_counter(), 0
        count += len(peer.ids(batch))
    return count / (time.perf_counter() - t_warm)


def resume(peer: Peer, result: Result, reference: list[int], n: int,
           log: Callable[[str], None]) -> None:
    """Run 40% of the epoch, take the state, restore it in a new loader, finish the epoch."""
    k = int(-(-n // BATCH) * RESUME_FRACTION)
    loader = peer.make()
    first_part: list[int] = []
    it = iter(loader)
    for _ in range(k):
        first_part += peer.ids(next(it))
    state = peer.state(loader, k)
    del it
    peer.close(loader)
    start = time.perf_counter()
    resumed = peer.restore(state)
    it = iter(resumed)
    batch = next(it)
    result.resume_seconds = time.perf_counter() - start
    second_part = list(peer.ids(batch))
    for batch in it:
        second_part += peer.ids(batch)
    del it
    peer.close(resumed)
    result.resume_kind = "state" if peer.resumable else "replay"
    got = first_part + second_part
    result.exact = "yes" if got == reference else "no"
    if got != reference:
        result.mismatch = _describe_mismatch(reference, got, len(first_part))
    log(f"  {peer.name}: resume ({result.resume_kind}) {result.resume_seconds:.2f} s to the "
        f"first batch, exact: {result.exact} {result.mismatch}")


class StallTest:
    """A consumer that works (sleeps) 1.25x the loader's per-batch time, run in chunks so that
    the loaders can take turns: stall fraction = time waiting in next() / wall time.

    After its warm-up batches and after each chunk, a loader is left alone for `SETTLE`
    seconds, outside the measured time: its workers refill their prefetch then (up to ~0.1 s
    of work for 4 batches of the slowest work here) instead of in the next loader's measured
    chunk, and its own first measured batch does not wait for the refill the warm-up emptied.
    Without it the chunks measured that interference as much as each loader's own stall: our
    loader measured 4.1% taking turns with six others and 1.2-2.4% alone."""

    CHUNK = 20
    SETTLE = 0.3

    def __init__(self, peer: Peer, result: Result, n: int, stall_batches: int) -> None:
        self.peer, self.result = peer, result
        self.work = 1.25 * BATCH / result.rate
        self.left = min(stall_batches, -(-n // BATCH) - WARMUP_BATCHES - 1)
        self.loader = peer.make()
        self.it = iter(self.loader)
        for _ in range(WARMUP_BATCHES):
            next(self.it)
        time.sleep(self.SETTLE)
        self.waited = self.wall = 0.0

    def chunk(self) -> None:
        start = time.perf_counter()
        for _ in range(min(self.CHUNK, self.left)):
            t0 = time.perf_counter()
            next(self.it)
            self.waited += time.perf_counter() - t0
            time.sleep(self.work)
            self.left -= 1
        self.wall += time.perf_counter() - start
        time.sleep(self.SETTLE)

    def finish(self) -> None:
        self.result.stall = self.waited / self.wall if self.wall else float("nan")
        del self.it
        self.peer.close(self.loader)


def _describe_mismatch(reference: list[int], got: list[int], cut: int) -> str:
    if len(got) != len(reference):
        extra = len(got) - len(reference)
        what = f"{extra} repeated" if extra > 0 else f"{-extra} missing"
        return f"({len(got)} samples vs {len(reference)}: {what})"
    first = next(i for i, (a, b) in enumerate(zip(reference, got)) if a != b)
    same_set = sorted(reference) == sorted(got)
    side = "before" if first < cut else "after"
    return (f"(first difference at sample {first}, {side} the resume point {cut}; "
            f"{'same samples, different order' if same_set else 'different samples'})")


def run(n: int, only: list[str] | None, stall_batches: int, rounds: int,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    images = prepare_images(n, log=log)
    loads = [load_average()]
    results: list[Result] = []
    live: list[tuple[Peer, Result, Any, list[int]]] = []

    def guarded(result: Result, what: Callable[[], Any]) -> Any:
        try:
            return what()
        except Exception as e:  # noqa: BLE001 - a peer that breaks is reported, not fatal
            log(traceback.format_exc())
            result.status = f"failed: {type(e).__name__}: {e}"[:200]
            return None

    # Phase 1, peer by peer: first batch and the reference epoch (which also warms up).
    for name, factory, module in PEERS:
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        try:
            import_streaming() if module == "streaming" else __import__(module)
        except ImportError:
            results.append(Result(name, "-", status="not installed"))
            log(f"  {name}: not installed")
            continue
        log(f"{name} ...")
        result = Result(name, "-")
        results.append(result)
        peer = guarded(result, lambda factory=factory: factory(images))
        if peer is None:
            continue
        result.fmt = peer.fmt
        if peer.note:
            result.notes.append(peer.note)
        started = guarded(result, lambda peer=peer, result=result: first_epoch(peer, result, n, log))
        if started is not None:
            live.append((peer, result, *started))
    # Phase 2: throughput, the loaders taking turns epoch by epoch (load from other processes
    # then hits all of them alike); the median over rounds.
    rates: dict[str, list[float]] = {r.name: [] for _, r, _, _ in live}
    for i in range(rounds):
        for peer, result, loader, _ in live:
            if result.status == "ok":
                rate = guarded(result, lambda peer=peer, loader=loader: epoch_rate(peer, loader))
                if rate is not None:
                    rates[result.name].append(rate)
        log(f"  throughput round {i + 1}: " + ", ".join(
            f"{name} {values[-1]:,.0f}" for name, values in rates.items() if values))
    for peer, result, loader, _ in live:
        if rates[result.name]:
            result.rate = statistics.median(rates[result.name])
            result.rates = rates[result.name]
        guarded(result, lambda peer=peer, loader=loader: peer.close(loader))
    # Phase 3, peer by peer: resume.
    for peer, result, _, reference in live:
        if result.status == "ok":
            guarded(result, lambda peer=peer, result=result, reference=reference:
                    resume(peer, result, reference, n, log))
    # Phase 4: stalls at 80% of the measured rate, the loaders taking turns chunk by chunk.
    tests = [t for peer, result, _, _ in live if result.status == "ok" and (
        t := guarded(result, lambda peer=peer, result=result:
                     StallTest(peer, result, n, stall_batches))) is not None]
    while any(t.left > 0 and t.result.status == "ok" for t in tests):
        for t in tests:
            if t.left > 0 and t.result.status == "ok":
                guarded(t.result, t.chunk)
    for t in tests:
        guarded(t.result, t.finish)
        log(f"  {t.result.name}: stall fraction {t.result.stall:.3f} at 80% load")
    loads.append(load_average())
    return {"images": describe(images), "machine": machine(), "load": loads, "rounds": rounds,
            "results": [r.__dict__ for r in results]}


def report(results: dict[str, Any]) -> str:
    lines = [
        f"# Loaders end to end: DecodeCropFlip({SIZE}), batch {BATCH}, {WORKERS} workers",
        f"{results['images']}; {results['machine']}",
        f"{results['load'][0]} before, {results['load'][1]} after",
        "",
    ]
    rows = []
    ours = next((r for r in results["results"] if r["name"] == "shardloader Loader"
                 and r["status"] == "ok"), None)
    for r in results["results"]:
        if r["status"] != "ok":
            rows.append([r["name"], r["fmt"], r["status"]] + ["-"] * 8)
            continue
        vs = (statistics.median(a / b for a, b in zip(ours["rates"], r["rates"]))
              if ours and ours["rates"] and r["rates"] else float("nan"))
        rows.append([r["name"], r["fmt"], "ok", r["rate"], spread(r["rates"]), vs,
                     r["rate"] / FFCV_MARK, r["ttfb"],
                     f"{r['resume_seconds']:.2f} ({r['resume_kind']})", r["exact"], r["stall"]])
    lines.append(table(["loader", "format", "status", "samples/s", "range", "shardloader / this",
                        "x FFCV 6,900", "first batch s", "resume s (how)", "resume exact",
                        "stall fraction @80%"], rows))
    notes = [f"- {r['name']}: {r['mismatch']}" for r in results["results"] if r.get("mismatch")]
    notes += [f"- {r['name']}: {note}" for r in results["results"] for note in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:"] + notes
    lines += ["", f"samples/s: median of {results['rounds']} epochs per loader, loaders taking "
              "turns (each epoch after its first 5 batches); shardloader / this: median of per-round "
              "ratios. first batch s: a fresh loader in this process (shardloader's comes first, so it "
              "includes about 0.4 s of one-time imports; FFCV's includes its JIT compilation). "
              "resume s: from "
              "restoring the state taken after 40% of the epoch to the next batch. resume exact: "
              "the resumed run's sample ids equal the uninterrupted run's, in order."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="images (default 20000)")
    parser.add_argument("--only", nargs="*", help="peers whose names contain these words")
    parser.add_argument("--stall-batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2,
                        help="throughput epochs per loader, interleaved (default 2)")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    results = run(args.n, args.only, args.stall_batches, args.rounds)
    emit(report(results), results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
