"""The cache ledger: typed records over sqlite, unreadable records treated as absent,
node-wide counters and the high-water mark."""

from __future__ import annotations

import gc
import os
import sqlite3
import threading

import pytest

from shardloader.cache.ledger import DB_NAME, Ledger, LedgerEntry, Reservation
from tests.proctree import answer_from_fork


def test_records_round_trip_and_forget(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.commit("a", LedgerEntry(100, 5.0))
    ledger.reserve("b", Reservation(50, 123, prefetch=True))
    assert ledger.entries() == {"a": LedgerEntry(100, 5.0)}
    assert ledger.atime("a") == 5.0 and ledger.opened_at("a") == 0.0
    assert ledger.reservations() == {"b": Reservation(50, 123, True)}
    ledger.touch("a", 7.0, opened=True)
    assert (ledger.atime("a"), ledger.opened_at("a")) == (7.0, 7.0)
    ledger.commit("b", LedgerEntry(50, 8.0))  # a commit replaces the download's reservation
    assert ledger.reservations() == {}
    ledger.forget("a")
    assert ledger.entry("a") is None and ledger.atime("a") == 0.0 and set(ledger.entries()) == {"b"}
    ledger.close()


def test_unreadable_records_are_absent_or_flagged(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger._db.set("entry/x", {"bytes": "many"})
    ledger._db.set("entry/y", {"bytes": -1})
    ledger._db.set("resv/z", "garbage")
    ledger._db.set("atime/x", "yesterday")
    assert ledger.entries() == {}
    assert ledger.reservations() == {"z": None}  # the store drops it
    assert ledger.atime("x") == 0.0
    ledger.close()


def test_redownloads_and_high_water_are_counted_for_the_node(tmp_path):
    first, second = Ledger(str(tmp_path)), Ledger(str(tmp_path))  # two processes' handles
    assert first.note_download("s", 10) is False
    first.note_evicted("s")
    assert second.note_download("s", 10) is True  # downloaded again after an eviction
    assert second.note_download("t", 5) is False
    assert first.node_counters() == {"downloads": 3, "redownloads": 1, "evictions": 1, "bytes_downloaded": 25}
    first.note_usage(300)
    second.note_usage(200)
    assert first.high_water() == second.high_water() == 300
    first.close()
    second.close()


def _ledger_descriptors(directory: str) -> int:
    """How many of this process's descriptors are open on the ledger database in `directory`."""
    database, count = os.path.realpath(os.path.join(directory, DB_NAME)), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == database
        except OSError:
            continue
    return count


def _use_the_inherited_ledgers(holder: dict, directory: str, conn) -> None:
    inherited = _ledger_descriptors(directory)
    holder["ledger"].count("downloads", 2)  # a ledger the child inherited opens its own connection
    holder.clear()  # what a worker does with the ledger it inherited: drops it, opens its own
    gc.collect()
    own = Ledger(directory)
    own.count("downloads", 3)
    conn.send((inherited, own.node_counters()["downloads"]))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_no_ledger_connection_crosses_a_fork(tmp_path):
    """sqlite's rule: a connection must not cross a fork, not even to be closed (a child's close
    can checkpoint and delete the write-ahead log the others use). The parent holds two open
    ledgers when it forks, one used last from a thread that is still running; the child
    inherits no descriptor on the database (the parent closed its connections before forking),
    uses one inherited ledger and a new one, and the parent's ledgers work on after the fork."""
    holder = {"ledger": Ledger(str(tmp_path)), "second": Ledger(str(tmp_path))}
    holder["second"].count("downloads")
    opened, stop = threading.Event(), threading.Event()

    def other_thread() -> None:
        holder["ledger"].count("downloads")  # a call from another thread
        opened.set()
        stop.wait()

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert opened.wait(30)
        assert _ledger_descriptors(str(tmp_path)) >= 2  # the parent's two connections
        _, (inherited, downloads) = answer_from_fork(_use_the_inherited_ledgers, holder, str(tmp_path))
    finally:
        stop.set()
        thread.join(30)
    assert inherited == 0, f"the child inherited {inherited} descriptors on the ledger"
    assert downloads == 7
    assert holder["ledger"].node_counters()["downloads"] == 7  # the parent's ledgers still work
    holder["second"].count("downloads")
    assert holder["ledger"].node_counters()["downloads"] == 8
    check = sqlite3.connect(str(tmp_path / DB_NAME))
    try:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        check.close()
    holder["ledger"].close()
    holder["second"].close()


def test_one_ledger_is_shared_by_threads(tmp_path):
    """A ledger has one connection per process, used by every thread in turn: concurrent
    updates from four threads all count."""
    ledger = Ledger(str(tmp_path))
    start = threading.Barrier(4)

    def count() -> None:
        start.wait()
        for _ in range(100):
            ledger.count("evictions")

    threads = [threading.Thread(target=count) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert ledger.node_counters()["evictions"] == 400
    ledger.close()
