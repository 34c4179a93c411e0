"""numba's on-disk cache made safe for processes that compile at the same time.

numba saves a compiled function by reading the function's index, taking the first data file
number the index does not name, writing the index, then the data, with no lock: two processes
compiling different signatures of one function at once (pytest's two workers on a cold cache, two
daemons starting) took the same number, and the index then named one signature's code for the
other's (the call failed with "can't unbox array", or ran code typed for other arguments). Here a
save holds an exclusive lock on a file beside the index and writes the data before the index
names it; a load holds a shared lock. Installed when ellmd is imported, before any kernel loads.
"""

import contextlib
import fcntl
import itertools

from numba.core import caching

_load_unlocked = caching.IndexDataCacheFile.load


@contextlib.contextmanager
def _locked(cache_file, operation):
    with open(cache_file._index_path + ".lock", "a") as lock:
        fcntl.flock(lock, operation)  # released when the file closes
        yield


def _save(self, key, data):
    with _locked(self, fcntl.LOCK_EX):
        overloads = self._load_index()
        name = overloads.get(key)
        if name is None:
            taken = set(overloads.values())
            name = next(n for n in map(self._data_name, itertools.count(1)) if n not in taken)
        self._save_data(name, data)
        overloads[key] = name
        self._save_index(overloads)


def _load(self, key):
    with _locked(self, fcntl.LOCK_SH):
        return _load_unlocked(self, key)


caching.IndexDataCacheFile.save = _save
caching.IndexDataCacheFile.load = _load
