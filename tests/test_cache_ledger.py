"""The cache ledger: typed records over diskcache, unreadable records treated as absent,
node-wide counters and the high-water mark."""

from __future__ import annotations

from shardloader.cache.ledger import Ledger, LedgerEntry, Reservation


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
