"""Retrieval for RAG: the retriever interface plugins implement, and the library of named indexes.

Layout under the library root (the daemon's rag directory), one folder per index:
  <name>/manifest.msgpack      the indexed folder, the retriever, chunking, per-file size, mtime_ns,
                               content hash and chunk ids, and every chunk's source, lines and text
  <name>/retriever-<gen>/      the retriever's own persistent index, generation <gen>

An index run copies the current generation's folder to the next one, applies the changes there,
and commits by replacing the manifest (which names the generation): a crash at any point leaves
the previous index whole, and searches keep using the previous generation until the commit.
Indexes hold the text of the files indexed: folders are 0700, files 0600.

Only regular files are read (a FIFO or a device named *.txt would block or never end), opened
without following symlinks; symlinked files and folders are left out, so nothing outside the
indexed folder is read.
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import msgpack

from ellmd.errors import EllmError

ENTRY_POINT_GROUP = "ellm.retrievers"
MANIFEST = "manifest.msgpack"
MANIFEST_VERSION = 1
MAX_FILE_BYTES = 2 * 1024 * 1024
PROGRESS_SECONDS = 0.5
# Tests only: seconds an index run sleeps per file, so that one is still running when a test acts
# on it (tests/test_rag.py). Unset in normal use.
INDEX_SLEEP = float(os.environ.get("ELLMD_TEST_INDEX_SLEEP", "0") or 0)

TEXT_SUFFIXES = frozenset(
    ".txt .md .markdown .rst .adoc .org .tex "
    ".py .pyi .ipy .js .jsx .mjs .cjs .ts .tsx .go .rs .c .h .cc .cpp .cxx .hh .hpp .hxx .cu "
    ".java .kt .kts .scala .swift .m .mm .rb .php .pl .pm .lua .r .jl .cs .fs .hs .ml .mli "
    ".ex .exs .erl .clj .dart .zig .nim .sql .sh .bash .zsh .fish .ps1 .bat .cmake .proto .graphql "
    ".json .jsonl .toml .yaml .yml .ini .cfg .conf .xml .html .htm .css .scss .sass .less .vue .svelte".split()
)
TEXT_NAMES = frozenset("Makefile Dockerfile README LICENSE CHANGELOG Jenkinsfile Gemfile Rakefile".split())
# Dependency, virtualenv, cache and build output folders: large, generated, rarely what an agent asks about.
SKIP_DIRS = frozenset("node_modules __pycache__ venv site-packages build dist target".split())
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RetrievalError(EllmError):
    """An unknown index or retriever, a folder that cannot be indexed (code not_found), or a bad
    index name or query (bad_request)."""

    def __init__(self, message: str, code: str = "not_found"):
        super().__init__(message)
        self.code = code


@dataclass
class Chunk:
    """A span of lines of one file, the unit a retriever indexes."""

    id: str
    source: str  # path relative to the indexed folder, posix
    start_line: int  # 1-based, inclusive
    end_line: int
    text: str


@dataclass
class Passage:
    """A search result: the chunk's text, where it comes from ("rel/path.md:12-40") and its score."""

    text: str
    source: str
    score: float

    def to_dict(self) -> dict:
        return {"text": self.text, "source": self.source, "score": self.score}


class Retriever(abc.ABC):
    """What a retriever plugin implements. It keeps an index of chunks in `directory` (its own, persistent).

    The library creates `directory` (empty, or a copy of the previous generation's) before
    constructing the retriever, calls add/remove then save, and from then on only search: the
    instance is never changed again, and its directory is deleted once a newer generation replaces
    it, so search must work from memory. search may run on another thread than the one that built it.
    """

    def __init__(self, directory: Path, options: dict):
        self.directory = Path(directory)
        self.options = dict(options)

    @abc.abstractmethod
    def add(self, chunks: list[Chunk]) -> None:
        """Index these chunks; an id already present is replaced."""

    @abc.abstractmethod
    def remove(self, chunk_ids: list[str]) -> None:
        """Forget these chunks; unknown ids are ignored."""

    @abc.abstractmethod
    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """Up to k (chunk_id, score) pairs, best first."""

    @abc.abstractmethod
    def save(self) -> None:
        """Persist the index in `directory`, atomically (see write_atomic)."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers, and a crash, see either the old content or the new one."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def retriever_names() -> list[str]:
    """The retrievers installed: entry points of the group "ellm.retrievers"."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_retriever_class(name: str) -> type[Retriever]:
    """The Retriever subclass installed under `name`."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise RetrievalError(f"unknown retriever {name!r}; installed: {', '.join(retriever_names()) or 'none'}")
    try:
        cls = found[0].load()
    except ModuleNotFoundError as e:
        raise RetrievalError(f"retriever {name!r} needs the Python package {e.name!r}: pip install {e.name}") from e
    except Exception as e:
        raise RetrievalError(f"retriever {name!r} ({found[0].value}) failed to load: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Retriever)):
        raise RetrievalError(f"retriever {name!r} ({found[0].value}) is not a Retriever subclass")
    return cls


def split_lines(text: str) -> list[str]:
    """Lines with their newline, split on "\\n" only so line numbers match editors'."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def chunk_text(text: str, source: str, chunk_lines: int = 40, overlap_lines: int = 8,
               chunk_chars: int = 1500) -> list[Chunk]:
    """Cut a file's text into chunks of at most chunk_lines lines and chunk_chars characters.

    Consecutive chunks share overlap_lines lines (fewer when the character limit made a chunk
    short, so that every chunk moves on by at least half its lines), so a passage that straddles
    a boundary is whole in one of them. A line longer than chunk_chars is cut into pieces that keep
    its line number. Chunks holding only whitespace are dropped.
    """
    pieces = [(number, line[at:at + chunk_chars])  # (1-based line number, text)
              for number, line in enumerate(split_lines(text), 1)
              for at in range(0, len(line), chunk_chars)]
    chunks = []
    start = 0
    while start < len(pieces):
        end, size = start, 0
        while end < len(pieces) and end - start < chunk_lines and (end == start or size + len(pieces[end][1]) <= chunk_chars):
            size += len(pieces[end][1])
            end += 1
        body = "".join(piece for _, piece in pieces[start:end])
        first, last = pieces[start][0], pieces[end - 1][0]
        if body.strip():
            digest = hashlib.blake2b(f"{source}\0{start}\0{body}".encode(), digest_size=8).hexdigest()
            chunks.append(Chunk(digest, source, first, last, body))
        if end == len(pieces):
            break
        start = max(end - min(overlap_lines, (end - start) // 2), start + 1)
    return chunks


def _walk(folder: Path):
    """Text, markdown and code files under folder, sorted; hidden entries, symlinks, special files
    (FIFOs, sockets, devices) and SKIP_DIRS left out. os.walk does not follow symlinked folders."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        for filename in sorted(filenames):
            path = Path(dirpath, filename)
            if filename.startswith(".") or not (path.suffix.lower() in TEXT_SUFFIXES or filename in TEXT_NAMES):
                continue
            try:
                if stat.S_ISREG(path.lstat().st_mode):
                    yield path
            except OSError:  # vanished
                continue


def read_regular(path: Path, limit: int) -> tuple[os.stat_result, bytes]:
    """(stat, bytes) of a regular file of at most `limit` bytes, opened without following a symlink
    and without blocking (a FIFO swapped in after the walk is refused, not waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError("too large")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError("too large")
    return st, data


@dataclass
class _Index:
    """One index as committed. Never changed once published (but for `retriever`, set once under the
    library lock), so a search can use it without holding a lock."""

    name: str
    path: str
    retriever_name: str
    generation: int
    chunking: list[int]
    updated: float
    files: dict  # rel path -> {"size", "mtime_ns", "hash", "chunks": [chunk ids]}
    chunks: dict  # chunk id -> [source, start_line, end_line, text]
    retriever: Retriever | None = field(default=None, repr=False)  # built on first search

    def summary(self) -> dict:
        return {"name": self.name, "path": self.path, "retriever": self.retriever_name,
                "files": len(self.files), "chunks": len(self.chunks), "updated": self.updated}


class RagLibrary:
    """Named indexes under `root` (the daemon's rag directory): each index = one folder, one retriever.

    index() may run on a worker thread while search() runs on another: an index run builds the next
    generation aside and publishes it at once, so a search sees the old index or the new one.
    """

    def __init__(self, root: Path, default_retriever: str = "bm25", chunk_lines: int = 40,
                 overlap_lines: int = 8, chunk_chars: int = 1500, retriever_options: dict[str, dict] | None = None):
        if not (chunk_lines >= 1 and 0 <= overlap_lines < chunk_lines and chunk_chars >= 1):
            raise RetrievalError(f"bad chunking: {chunk_lines} lines, {overlap_lines} overlap, {chunk_chars} chars")
        self.root = Path(root)
        self.default_retriever = default_retriever
        self.chunking = [chunk_lines, overlap_lines, chunk_chars]
        self.retriever_options = retriever_options or {}
        self._lock = threading.Lock()  # guards _indexes and _writers
        self._indexes: dict[str, _Index] = {}
        self._writers: dict[str, threading.Lock] = {}  # one index run or removal per name at a time

    def index(self, path: Path, name: str = "default", retriever: str | None = None, progress=None,
              cancelled: threading.Event | None = None) -> dict:
        """(Re)index folder `path` into index `name`; only new and changed files are read and chunked.

        A file whose size and mtime are unchanged, or whose content hash is, keeps its chunks. A new
        retriever (or new chunking settings) rebuilds the index; `retriever` None keeps the index's
        own, or the default for a new index. progress, if given, is called now and then with
        {"files_done", "files_total", "path"}. Once `cancelled` is set the run stops at its next
        file, or before its commit, with RetrievalError (code "cancelled"): the index stays as it was.
        """
        started = time.monotonic()
        _check_name(name)
        folder = Path(path).expanduser().resolve()
        if not folder.is_dir():
            raise RetrievalError(f"cannot index {path}: {'not a directory' if folder.exists() else 'no such folder'}")
        with self._writer(name):
            with self._lock:
                old = self._get(name, missing_ok=True)
            if old is not None and old.path != str(folder):
                raise RetrievalError(f"index {name!r} holds {old.path}; pick another name, or remove {name!r} first")
            retriever_name = retriever or (old.retriever_name if old else self.default_retriever)
            cls = load_retriever_class(retriever_name)
            rebuild = old is None or old.retriever_name != retriever_name or old.chunking != self.chunking
            old_files, old_chunks = ({}, {}) if rebuild else (old.files, old.chunks)
            stop = _Cancel(name, cancelled)
            files, chunks, counts = self._scan(folder, old_files, old_chunks, progress, stop)

            removed = [cid for cid in old_chunks if cid not in chunks]
            added = [Chunk(cid, *chunks[cid]) for cid in chunks if cid not in old_chunks]
            directory = self.root / name
            generation = old.generation if old else 0
            instance = old.retriever if old else None
            if rebuild or removed or added:
                generation += 1
                instance = self._build(cls, retriever_name, directory, old, generation, rebuild, removed, added)
                stop.check(lambda: shutil.rmtree(directory / f"retriever-{generation}", ignore_errors=True))
            state = _Index(name, str(folder), retriever_name, generation, list(self.chunking), time.time(),
                           files, chunks, instance)
            write_atomic(directory / MANIFEST, msgpack.packb({
                "version": MANIFEST_VERSION, "path": state.path, "retriever": retriever_name,
                "generation": generation, "chunking": state.chunking, "updated": state.updated,
                "files": files, "chunks": chunks}))
            with self._lock:
                self._indexes[name] = state
            for stale in directory.glob("retriever-*"):  # older generations, or a crashed run's
                if stale.name != f"retriever-{generation}":
                    shutil.rmtree(stale, ignore_errors=True)
            return {"name": name, "path": state.path, "retriever": retriever_name, "files": len(files),
                    **counts, "files_removed": sum(rel not in files for rel in (old.files if old else {})),
                    "chunks": len(chunks), "seconds": round(time.monotonic() - started, 3)}

    def _scan(self, folder: Path, old_files: dict, old_chunks: dict, progress, stop: _Cancel):
        """(files, chunks, counts) of the folder now: new and changed files read and chunked."""
        files, chunks = {}, {}
        counts = {"files_indexed": 0, "files_unchanged": 0, "files_skipped": 0}
        candidates = list(_walk(folder))
        last_report = time.monotonic()
        for done, file in enumerate(candidates, 1):
            stop.check()
            if INDEX_SLEEP:
                time.sleep(INDEX_SLEEP)
            rel = file.relative_to(folder).as_posix()
            result = self._read(file, rel, old_files.get(rel), counts)
            if result is not None:
                entry, new_chunks = result
                files[rel] = entry
                if new_chunks is None:  # unchanged: keep the chunks already indexed
                    chunks.update((cid, old_chunks[cid]) for cid in entry["chunks"])
                else:
                    chunks.update((c.id, [c.source, c.start_line, c.end_line, c.text]) for c in new_chunks)
            if progress is not None and (done == len(candidates) or time.monotonic() - last_report >= PROGRESS_SECONDS):
                progress({"files_done": done, "files_total": len(candidates), "path": rel})
                last_report = time.monotonic()
        return files, chunks, counts

    def search(self, query: str, k: int = 4, name: str = "default") -> list[Passage]:
        """The k passages of index `name` that best match `query`, best first."""
        _check_name(name)
        if not query.strip():
            raise RetrievalError("empty query: say what to search for", "bad_request")
        if k < 1:
            raise RetrievalError(f"k must be at least 1, not {k}", "bad_request")
        with self._lock:
            state = self._get(name)
            if state.retriever is None:
                cls = load_retriever_class(state.retriever_name)
                state.retriever = cls(self.root / name / f"retriever-{state.generation}",
                                      self.retriever_options.get(state.retriever_name, {}))
        passages = []
        for chunk_id, score in state.retriever.search(query, k):
            source, start, end, text = state.chunks[chunk_id]
            passages.append(Passage(text, f"{source}:{start}-{end}", float(score)))
        return passages

    def list(self) -> list[dict]:
        """Every index: {"name", "path", "retriever", "files", "chunks", "updated"} (unix time)."""
        if not self.root.is_dir():
            return []
        names = sorted(p.parent.name for p in self.root.glob(f"*/{MANIFEST}") if NAME_PATTERN.fullmatch(p.parent.name))
        with self._lock:
            return [self._get(name).summary() for name in names]

    def remove(self, name: str) -> dict:
        """Delete index `name` (not the folder it indexes); returns its summary."""
        _check_name(name)
        with self._writer(name):
            with self._lock:
                try:
                    summary = self._get(name).summary()
                except RetrievalError:
                    if not (self.root / name / MANIFEST).is_file():
                        raise
                    summary = {"name": name}  # unreadable: remove it all the same
                self._indexes.pop(name, None)
            # Rename first so that a crash mid-delete leaves no half index under the name.
            doomed = self.root / f".{name}.removed-{os.getpid()}-{time.monotonic_ns()}"
            os.replace(self.root / name, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            return summary

    def _writer(self, name: str) -> threading.Lock:
        with self._lock:
            return self._writers.setdefault(name, threading.Lock())

    def _get(self, name: str, missing_ok: bool = False) -> _Index | None:
        """The committed index `name`, loaded from its manifest on first use (call with self._lock held)."""
        if name in self._indexes:
            return self._indexes[name]
        manifest = self.root / name / MANIFEST
        if not manifest.is_file():
            if missing_ok:
                return None
            existing = sorted(p.parent.name for p in self.root.glob(f"*/{MANIFEST}")) if self.root.is_dir() else []
            raise RetrievalError(f"no index {name!r}; existing: {', '.join(existing) or 'none (index a folder first)'}")
        try:
            m = msgpack.unpackb(manifest.read_bytes(), strict_map_key=False)
            if m["version"] != MANIFEST_VERSION:
                raise ValueError(f"manifest version {m['version']}")
            state = _Index(name, m["path"], m["retriever"], m["generation"], m["chunking"], m["updated"],
                           m["files"], m["chunks"])
        except Exception as e:
            raise RetrievalError(f"index {name!r} is unreadable ({e}); remove it and index again") from e
        self._indexes[name] = state
        return state

    def _read(self, file: Path, rel: str, old: dict | None, counts: dict):
        """(manifest entry, new chunks or None when unchanged) for one file, or None when skipped."""
        try:
            st = file.lstat()
            if st.st_size > MAX_FILE_BYTES:
                raise ValueError("too large")
            if old is not None and (old["size"], old["mtime_ns"]) == (st.st_size, st.st_mtime_ns):
                counts["files_unchanged"] += 1
                return old, None
            st, data = read_regular(file, MAX_FILE_BYTES)
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "hash": digest}
            if old is not None and old["hash"] == digest:
                counts["files_unchanged"] += 1
                return {**entry, "chunks": old["chunks"]}, None
            if b"\0" in data:
                raise ValueError("binary")
            text = data.decode("utf-8-sig")
        except (OSError, ValueError):  # vanished, unreadable, too large, binary, not UTF-8
            counts["files_skipped"] += 1
            return None
        counts["files_indexed"] += 1
        new_chunks = chunk_text(text, rel, *self.chunking)
        return {**entry, "chunks": [c.id for c in new_chunks]}, new_chunks

    def _build(self, cls, retriever_name, directory, old, generation, rebuild, removed, added) -> Retriever:
        """The next generation of the retriever's index: a copy of the current one with the changes applied."""
        target = directory / f"retriever-{generation}"
        shutil.rmtree(target, ignore_errors=True)  # left by a run that crashed before its commit
        if rebuild:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            directory.mkdir(exist_ok=True, mode=0o700)
            target.mkdir(mode=0o700)
        else:
            shutil.copytree(directory / f"retriever-{old.generation}", target)
        instance = cls(target, self.retriever_options.get(retriever_name, {}))
        if removed:
            instance.remove(removed)
        if added:
            instance.add(added)
        instance.save()
        return instance


class _Cancel:
    """Where an index run looks whether it was cancelled (a client's cancel, or the daemon's shutdown)."""

    def __init__(self, name: str, event: threading.Event | None):
        self.name, self.event = name, event

    def check(self, undo=None) -> None:
        if self.event is not None and self.event.is_set():
            if undo is not None:
                undo()
            raise RetrievalError(f"indexing {self.name!r} was cancelled; the index is as it was", "cancelled")


def _check_name(name) -> None:
    """An index name is a plain folder name: never a path (`../x`, `/etc`) that leaves the library."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise RetrievalError(f"bad index name {name!r}: letters, digits, '.', '_' and '-', at most 64, "
                             "starting with a letter or digit", "bad_request")
