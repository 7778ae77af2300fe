"""A batch that could not be made: the dataset's own error, handed to the caller as
DataLoader hands it.

When reading or transforming a sample raises, DataLoader raises that exception from `next()`
for the batch that needed it and goes on with the next batch. The Loader does the same:

- the producer wraps the error in `SampleFailed`, naming the sample when it is known (a
  map-style `dataset[i]`, a transform of one sample; a shard read names its shard itself);
- a pool hands back a `BatchFailure` in the batch's place: the original exception in this
  process (no workers, or threads), or, from a worker process, one rebuilt by `rebuild` with
  the dataset's own exception type and the worker's traceback in its message;
- the epoch iterator counts the batch as consumed and raises the error; the iterator stays
  usable. A worker that dies is not a batch failure: that is `WorkerError`, and ends the epoch.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any


class SampleFailed(Exception):
    """Raised inside the producer: `error` came from reading or transforming `sample` (a
    global sample index; None when the failing read covered several samples)."""

    def __init__(self, error: BaseException, sample: int | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.sample = sample


@dataclass(frozen=True)
class BatchFailure:
    """What a pool hands back in place of a batch whose production raised `error`."""

    error: BaseException


@dataclass(frozen=True)
class FailureRecord:
    """A worker's failure, as it travels to the training process: the exception's class (None
    when it cannot travel: a class defined inside a function) and the text to rebuild it
    with (what happened, where, and the worker's traceback)."""

    exc_type: type[BaseException] | None
    message: str
    attributes: dict[str, Any] | None = None  # the exception's own attributes, when they pickle


def where(epoch: int, step: int, sample: int | None) -> str:
    """'batch 3 of epoch 0, sample 17': the place a failure names."""
    return f"batch {step} of epoch {epoch}" + ("" if sample is None else f", sample {sample}")


def unwrap(error: BaseException) -> tuple[BaseException, int | None]:
    """The dataset's own exception and the failing sample (when known) of a producer error."""
    if isinstance(error, SampleFailed):
        return error.error, error.sample
    return error, None


def in_this_process(error: BaseException, epoch: int, step: int) -> BatchFailure:
    """A failure of a batch made in this process: the original exception, with a note (PEP
    678: shown under its traceback) saying which batch and sample it broke."""
    original, sample = unwrap(error)
    original.add_note(f"shardloader: raised while producing {where(epoch, step, sample)}")
    return BatchFailure(original)


def record_in_worker(error: BaseException, worker_id: int, epoch: int, step: int) -> FailureRecord:
    """Describe a failure inside worker process `worker_id`, to send it to the training process.

    The message's first line is the cause (the original message: which shard or sample, what
    is wrong), then where it happened: "bad pixels in sample 17 (in shardloader worker process
    0, batch 3 of epoch 0, sample 17)"; the worker's traceback follows below it. Log lines,
    alerts and UIs that show one line then show the cause (DataLoader's "Caught X in DataLoader
    worker process N." names it only after the traceback)."""
    original, sample = unwrap(error)
    exc_type: type[BaseException] | None = type(original)
    try:
        pickle.dumps(exc_type)
    except Exception:  # noqa: BLE001 - e.g. a class defined inside a function
        exc_type = None
    attributes: dict[str, Any] | None = dict(vars(original)) or None
    try:
        pickle.dumps(attributes)
    except Exception:  # noqa: BLE001 - attributes that cannot travel are left behind
        attributes = None
    trace = "".join(traceback.format_exception(original))
    cause = str(original) or type(original).__name__
    if exc_type is None:  # rebuilt as RuntimeError: the first line names the type it had
        cause = f"{type(original).__name__}: {cause}"
    first, newline, rest = cause.partition("\n")
    message = (f"{first} (in shardloader worker process {worker_id}, {where(epoch, step, sample)})"
               f"{newline}{rest}\n\nOriginal {trace}")
    return FailureRecord(exc_type, message, attributes)


class _PlainMessage(str):
    """A message that prints as itself: KeyError shows its argument's repr, which would
    escape every line break of the traceback."""

    def __repr__(self) -> str:
        return str(self)


def rebuild(record: FailureRecord) -> BaseException:
    """The exception `next()` raises for a worker's failure: the dataset's own type, so that
    `except ValueError:` keeps working, with the message as its argument and its attributes
    restored. A type whose constructor wants other arguments is made without calling it (where
    DataLoader raises RuntimeError); RuntimeError with the same message only when even that
    fails."""
    exc_type: Any = record.exc_type
    message: str = record.message
    if exc_type is KeyError:
        message = _PlainMessage(message)
    if exc_type is not None:
        try:
            error = exc_type(message)
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments: make it
            try:           # without calling it, its message as its only argument
                error = exc_type.__new__(exc_type, message)
                error.args = (message,)
            except Exception:  # noqa: BLE001
                error = None
        if isinstance(error, BaseException):
            try:
                vars(error).update(record.attributes or {})
            except Exception:  # noqa: BLE001 - attributes the class does not let us set
                pass
            return error
    return RuntimeError(message)
