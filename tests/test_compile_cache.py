"""numba's cache under two processes saving one function's signatures at once (ellmd.compile_cache)."""

from __future__ import annotations

import threading

from numba.core import caching

import ellmd.compile_cache  # noqa: F401  (installed by importing ellmd; named for the reader)


def test_two_saves_at_once_keep_each_signature_with_its_code(tmp_path):
    """The second save starts while the first has read the index: unlocked, both took data file 1
    and the index named the other's code. Locked, the second waits, then takes file 2."""
    first, second = (caching.IndexDataCacheFile(str(tmp_path), "f-1.py311", "stamp") for _ in range(2))
    first_read, second_read = threading.Event(), threading.Event()
    read_index = first._load_index

    def read_then_let_the_second_in():
        overloads = read_index()
        first_read.set()
        second_read.wait(timeout=2)  # unlocked, the second reads the same index meanwhile
        return overloads

    first._load_index = read_then_let_the_second_in
    second_index = second._load_index

    def second_reads():
        second_read.set()
        return second_index()

    second._load_index = second_reads

    def save_second():
        first_read.wait()
        second.save("signature b", "code of b")

    thread = threading.Thread(target=save_second)
    thread.start()
    first.save("signature a", "code of a")
    thread.join()
    reader = caching.IndexDataCacheFile(str(tmp_path), "f-1.py311", "stamp")
    assert reader.load("signature a") == "code of a"
    assert reader.load("signature b") == "code of b"
