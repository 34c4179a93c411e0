"""Retrieval for RAG: chunking, the BM25 retriever, the index library and retriever plugins."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from ellm.errors import Cancelled
from ellm_bm25 import BM25Retriever, tokenize
from ellmd.errors import EllmError
from ellmd.runtime.context.retrieval import (
    MANIFEST,
    Chunk,
    RagLibrary,
    RetrievalError,
    chunk_text,
    load_retriever_class,
    retriever_names,
    split_lines,
)

from daemon import ROOT, Daemon

DOCS = {
    "astronomy.md": "# Telescopes\n\nA reflecting telescope gathers light from distant galaxies with a curved mirror.\n"
                    "Astronomers measure redshift to estimate how far away each galaxy is.\n",
    "cooking.txt": "Knead the bread dough for ten minutes, then let the yeast rise in a warm kitchen.\n"
                   "Bake the loaf until the crust is golden.\n",
    "src/config.py": "import json\n\n\ndef parseConfig(path):\n    \"\"\"Read the settings file.\"\"\"\n"
                     "    with open(path) as f:\n        return json.load(f)\n",
    "notes/sailing.rst": "Sailing upwind needs the jib trimmed tight and the mainsheet eased in gusts.\n",
}


def write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def lines_of(folder: Path, source: str) -> str:
    """The text that a passage source "rel:start-end" names, read from the file."""
    rel, _, span = source.rpartition(":")
    start, end = map(int, span.split("-"))
    return "".join(split_lines((folder / rel).read_text())[start - 1:end])


@pytest.fixture
def corpus(tmp_path):
    return write_tree(tmp_path / "docs", DOCS)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Two retriever plugins registered the way a third-party package is: a dist-info with entry points."""
    site = tmp_path / "site"
    write_tree(site, {
        "ellm_test_plugins.py": "from ellm_bm25 import BM25Retriever\n\n"
                                "class Flaky(BM25Retriever):\n"
                                "    fail = False\n"
                                "    def save(self):\n"
                                "        super().save()\n"
                                "        if Flaky.fail:\n"
                                "            raise OSError('disk full')\n",
        "ellm_test_broken.py": "import ellm_no_such_package\n",
        "ellm_test_plugins-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: ellm-test-plugins\nVersion: 0.1\n",
        "ellm_test_plugins-0.1.dist-info/entry_points.txt": "[ellm.retrievers]\nflaky = ellm_test_plugins:Flaky\n"
                                                            "broken = ellm_test_broken:Broken\n",
    })
    monkeypatch.syspath_prepend(str(site))
    yield
    for module in ("ellm_test_plugins", "ellm_test_broken"):
        sys.modules.pop(module, None)


# Chunking


def test_chunks_cover_every_line_and_overlap_by_the_configured_lines():
    lines = [f"line {i} says something about topic {i % 7}\n" for i in range(1, 101)]
    chunks = chunk_text("".join(lines), "a.txt", chunk_lines=10, overlap_lines=3, chunk_chars=10_000)
    assert chunks[0].start_line == 1 and chunks[-1].end_line == 100
    covered = set()
    for chunk in chunks:
        assert chunk.source == "a.txt" and chunk.end_line - chunk.start_line + 1 <= 10
        assert chunk.text == "".join(lines[chunk.start_line - 1:chunk.end_line])
        covered.update(range(chunk.start_line, chunk.end_line + 1))
    assert covered == set(range(1, 101))
    for before, after in zip(chunks, chunks[1:]):
        assert after.start_line == before.end_line - 3 + 1  # exactly 3 shared lines
    assert len({c.id for c in chunks}) == len(chunks)


def test_chunks_respect_the_character_limit_and_cut_long_lines():
    text = "short\n" + "x" * 3500 + "\n" + "\n".join(f"{'y' * 90} {i}" for i in range(30)) + "\n"
    chunks = chunk_text(text, "b.txt", chunk_lines=40, overlap_lines=8, chunk_chars=1000)
    assert all(len(c.text) <= 1000 for c in chunks)
    pieces = [c.text for c in chunks if c.start_line == 2]  # the long line cut in 4, the last with lines after it
    assert len(pieces) == 4 and "".join(pieces[:3]) + pieces[3].split("\n")[0] == "x" * 3500  # nothing lost
    assert {n for c in chunks for n in range(c.start_line, c.end_line + 1)} == set(range(1, 33))


def test_blank_text_gives_no_chunks():
    assert chunk_text("", "e.md") == [] and chunk_text("\n  \n\n", "e.md") == []


# BM25


def test_tokenize_splits_identifiers_and_drops_stop_words():
    assert tokenize("The parseConfig of HTTPServer") == ["parseconfig", "parse", "config", "httpserver", "http", "server"]
    assert tokenize("load_kv_cache(x)") == ["load_kv_cache", "load", "kv", "cache", "x"]
    assert tokenize("is it in the") == []


def bm25_by_hand(docs: dict[str, str], query: str, k1=1.5, b=0.75) -> dict[str, float]:
    """Okapi BM25 with Lucene's idf, straight from the formula."""
    tf = {cid: Counter(tokenize(text)) for cid, text in docs.items()}
    avgdl = sum(sum(c.values()) for c in tf.values()) / len(docs)
    scores = {}
    for cid, counts in tf.items():
        score = 0.0
        for term in set(tokenize(query)):
            df = sum(term in c for c in tf.values())
            if counts[term]:
                idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
                dl = sum(counts.values())
                score += idf * counts[term] * (k1 + 1) / (counts[term] + k1 * (1 - b + b * dl / avgdl))
        if score > 0:
            scores[cid] = score
    return scores


TINY = {
    "d1": "the cat sat on the mat with another cat",
    "d2": "a dog chased the cat around the garden",
    "d3": "stock markets fell as interest rates rose",
    "d4": "the garden mat was wet",
}


def build(directory: Path, docs: dict[str, str], **options) -> BM25Retriever:
    directory.mkdir(parents=True, exist_ok=True)
    retriever = BM25Retriever(directory, options)
    retriever.add([Chunk(cid, "t.txt", 1, 1, text) for cid, text in docs.items()])
    return retriever


@pytest.mark.parametrize("query", ["cat", "cat mat", "garden dog", "interest rates", "cat cat garden"])
def test_bm25_scores_match_the_formula(tmp_path, query):
    hits = build(tmp_path, TINY).search(query, k=10)
    expected = bm25_by_hand(TINY, query)
    assert [cid for cid, _ in hits] == sorted(expected, key=lambda c: (-expected[c], c))
    for cid, score in hits:
        assert score == pytest.approx(expected[cid], rel=1e-12)


def test_bm25_options_change_the_scores(tmp_path):
    hits = dict(build(tmp_path, TINY, k1=1.2, b=0.5).search("cat mat", k=10))
    expected = bm25_by_hand(TINY, "cat mat", k1=1.2, b=0.5)
    assert hits == pytest.approx(expected, rel=1e-12)
    with pytest.raises(RetrievalError, match="unknown bm25 option"):
        BM25Retriever(tmp_path, {"k2": 1})


def test_bm25_add_and_remove_equal_a_build_from_scratch(tmp_path):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    docs = {f"c{i}": " ".join(words[j % len(words)] for j in range(i, i + 3 + i % 5)) for i in range(30)}
    incremental = build(tmp_path / "inc", docs)
    incremental.remove(["c3", "c7", "c11", "unknown"])
    changes = {"c7": "alpha alpha omega", "c40": "theta omega kappa", "c41": "beta beta beta"}
    incremental.add([Chunk(cid, "t.txt", 1, 1, text) for cid, text in changes.items()])
    incremental.remove(["c20"])
    incremental.add([Chunk("c5", "t.txt", 1, 1, "omega lambda")])  # replaces c5 in place
    final = {cid: text for cid, text in docs.items() if cid not in {"c3", "c7", "c11", "c20"}}
    final |= changes | {"c5": "omega lambda"}
    scratch = build(tmp_path / "scratch", final)
    incremental.save()
    reloaded = BM25Retriever(tmp_path / "inc", {})
    for query in ["alpha", "omega theta", "beta gamma delta", "kappa lambda iota", "zeta"]:
        expected = scratch.search(query, k=50)
        assert expected and incremental.search(query, k=50) == expected
        assert reloaded.search(query, k=50) == expected
        assert dict(expected) == pytest.approx(bm25_by_hand(final, query), rel=1e-12)


# The library


def test_search_returns_the_file_about_the_query_with_its_lines(tmp_path, corpus):
    library = RagLibrary(tmp_path / "rag")
    report = library.index(corpus)
    assert report["name"] == "default" and report["retriever"] == "bm25" and report["path"] == str(corpus.resolve())
    assert report["files"] == report["files_indexed"] == 4 and report["files_unchanged"] == report["files_removed"] == 0
    for query, source in [("telescope galaxies", "astronomy.md"), ("bake bread with yeast", "cooking.txt"),
                          ("parse config", "src/config.py"), ("jib mainsheet", "notes/sailing.rst")]:
        passages = library.search(query, k=2)
        assert passages[0].source.startswith(source + ":")
        assert passages[0].text == lines_of(corpus, passages[0].source)
        assert passages[0].score > 0 and all(p.score <= passages[0].score for p in passages)
        assert passages[0].to_dict() == {"text": passages[0].text, "source": passages[0].source, "score": passages[0].score}
    assert library.search("quantum chromodynamics") == []


def test_multi_chunk_file_points_at_the_right_lines(tmp_path):
    lines = [f"filler line number {i} about nothing much\n" for i in range(1, 61)]
    lines[44] = "the secret ingredient is smoked paprika\n"  # line 45
    folder = write_tree(tmp_path / "docs", {"long.md": "".join(lines)})
    library = RagLibrary(tmp_path / "rag", chunk_lines=10, overlap_lines=2)
    assert library.index(folder)["chunks"] == 8  # chunks start at lines 1, 9, 17, 25, 33, 41, 49, 57
    best = library.search("smoked paprika", k=1)[0]
    assert best.source == "long.md:41-50" and "smoked paprika" in best.text
    assert best.text == lines_of(folder, best.source)


def test_the_index_persists_and_reindexing_reads_only_changed_files(tmp_path, corpus):
    RagLibrary(tmp_path / "rag").index(corpus, name="docs")
    library = RagLibrary(tmp_path / "rag")  # a new process, as after a daemon restart
    assert library.search("telescope", name="docs")[0].source.startswith("astronomy.md:")
    again = library.index(corpus, name="docs")
    assert (again["files_unchanged"], again["files_indexed"], again["files_removed"]) == (4, 0, 0)

    os.utime(corpus / "cooking.txt", ns=(1, 1))  # a new mtime, the same content: the hash says unchanged
    (corpus / "astronomy.md").write_text("Volcanoes erupt when magma pressure builds beneath the crust.\n")
    report = library.index(corpus, name="docs")
    assert (report["files_unchanged"], report["files_indexed"], report["files_removed"]) == (3, 1, 0)
    assert library.search("telescope galaxies", name="docs") == []
    volcano = library.search("magma volcanoes", name="docs")[0]
    assert volcano.source == "astronomy.md:1-1" and volcano.text.startswith("Volcanoes erupt")

    (corpus / "notes/sailing.rst").unlink()
    report = library.index(corpus, name="docs")
    assert (report["files"], report["files_unchanged"], report["files_indexed"], report["files_removed"]) == (3, 3, 0, 1)
    assert library.search("jib mainsheet sailing", name="docs") == []
    assert [p.name for p in (tmp_path / "rag" / "docs").iterdir() if p.name.startswith("retriever-")] == ["retriever-3"]
    reopened = RagLibrary(tmp_path / "rag")
    assert reopened.search("magma", name="docs") == library.search("magma", name="docs")


def test_the_walk_skips_hidden_vendored_binary_large_and_non_utf8_files(tmp_path):
    folder = write_tree(tmp_path / "docs", {
        "keep.md": "kept words\n",
        "deep/er/keep.go": "package kept\n",
        "Makefile": "all: kept\n",
        ".hidden.md": "kept hidden\n",
        ".git/HEAD.txt": "kept git\n",
        "node_modules/lib/index.js": "kept vendored\n",
        "__pycache__/x.py": "kept cache\n",
        "image.png": b"\x89PNG kept",
        "latin1.txt": "kept caf\xe9\n".encode("latin-1"),
        "nul.json": b"kept\x00binary",
        "huge.txt": b"kept " * (2 * 1024 * 1024 // 5 + 1),
    })
    library = RagLibrary(tmp_path / "rag")
    report = library.index(folder)
    assert (report["files"], report["files_skipped"]) == (3, 3)
    assert sorted(p.source.split(":")[0] for p in library.search("kept", k=10)) == ["Makefile", "deep/er/keep.go", "keep.md"]


def test_progress_reports_reach_the_last_file(tmp_path):
    folder = write_tree(tmp_path / "docs", {f"f{i:02}.txt": f"file {i}\n" for i in range(12)})
    reports = []
    RagLibrary(tmp_path / "rag").index(folder, progress=reports.append)
    assert reports[-1] == {"files_done": 12, "files_total": 12, "path": "f11.txt"}
    assert all(r["files_total"] == 12 and 1 <= r["files_done"] <= 12 for r in reports)


def test_list_and_remove(tmp_path, corpus):
    library = RagLibrary(tmp_path / "rag")
    assert library.list() == []
    library.index(corpus, name="a")
    library.index(corpus / "src", name="b")
    listed = library.list()
    assert [(i["name"], i["files"], i["retriever"], i["path"]) for i in listed] == [
        ("a", 4, "bm25", str(corpus.resolve())), ("b", 1, "bm25", str((corpus / "src").resolve()))]
    assert listed[0]["chunks"] == 4 and listed[0]["updated"] > 0
    assert library.remove("a")["name"] == "a"
    assert [i["name"] for i in RagLibrary(tmp_path / "rag").list()] == ["b"]
    assert sorted(p.name for p in (tmp_path / "rag").iterdir()) == ["b"]
    with pytest.raises(RetrievalError, match="no index 'a'; existing: b"):
        library.search("telescope", name="a")
    assert library.index(corpus, name="a")["files_indexed"] == 4  # the name is free again


def test_errors_are_one_clear_line(tmp_path, corpus):
    library = RagLibrary(tmp_path / "rag")
    with pytest.raises(RetrievalError, match=r"no index 'default'; existing: none"):
        library.search("anything")
    with pytest.raises(RetrievalError, match="no such folder"):
        library.index(tmp_path / "nowhere")
    with pytest.raises(RetrievalError, match="not a directory"):
        library.index(corpus / "cooking.txt")
    with pytest.raises(RetrievalError, match=r"unknown retriever 'nope'; installed: .*bm25"):
        library.index(corpus, retriever="nope")
    with pytest.raises(RetrievalError, match="bad index name"):
        library.index(corpus, name="../elsewhere")
    library.index(corpus, name="docs")
    with pytest.raises(RetrievalError, match=r"index 'docs' holds .*pick another name, or remove 'docs' first"):
        library.index(corpus / "src", name="docs")
    with pytest.raises(RetrievalError, match="no index 'doc'; existing: docs"):
        library.search("telescope", name="doc")
    with pytest.raises(RetrievalError, match="empty query"):
        library.search("  ", name="docs")
    assert issubclass(RetrievalError, EllmError)


def test_a_damaged_index_says_so_and_can_be_removed(tmp_path, corpus):
    RagLibrary(tmp_path / "rag").index(corpus)
    (tmp_path / "rag" / "default" / MANIFEST).write_bytes(b"\xc1 not msgpack")
    library = RagLibrary(tmp_path / "rag")
    with pytest.raises(RetrievalError, match="index 'default' is unreadable .*remove it and index again"):
        library.search("telescope")
    assert library.remove("default") == {"name": "default"}
    assert library.index(corpus)["files_indexed"] == 4


def test_bm25_is_found_through_its_entry_point():
    (ep,) = [ep for ep in entry_points(group="ellm.retrievers") if ep.name == "bm25"]
    assert ep.value == "ellm_bm25:BM25Retriever"
    assert "bm25" in retriever_names() and load_retriever_class("bm25") is BM25Retriever


def test_a_plugin_whose_dependency_is_missing_says_what_to_install(plugins):
    assert {"flaky", "broken"} <= set(retriever_names())
    with pytest.raises(RetrievalError, match="retriever 'broken' needs the Python package 'ellm_no_such_package'"):
        load_retriever_class("broken")


def test_a_failed_index_run_leaves_the_previous_index_whole(tmp_path, corpus, plugins):
    library = RagLibrary(tmp_path / "rag")
    assert library.index(corpus, retriever="flaky")["retriever"] == "flaky"
    before = library.search("telescope galaxies")
    import ellm_test_plugins

    ellm_test_plugins.Flaky.fail = True
    (corpus / "astronomy.md").write_text("Volcanoes erupt when magma pressure builds.\n")
    with pytest.raises(OSError, match="disk full"):
        library.index(corpus)
    assert library.search("telescope galaxies") == before  # in memory
    assert RagLibrary(tmp_path / "rag").search("telescope galaxies") == before  # and on disk
    ellm_test_plugins.Flaky.fail = False
    report = library.index(corpus)
    assert (report["retriever"], report["files_indexed"]) == ("flaky", 1)  # the index keeps its retriever
    assert library.search("magma")[0].source == "astronomy.md:1-1"
    assert sorted(p.name for p in (tmp_path / "rag" / "default").iterdir()) == [MANIFEST, "retriever-2"]


def test_a_cancelled_index_run_leaves_the_index_as_it_was(tmp_path, corpus):
    library = RagLibrary(tmp_path / "rag")
    library.index(corpus, name="docs")
    (corpus / "new.md").write_text("Fresh words about gardening.\n")
    at_once = threading.Event()
    at_once.set()
    with pytest.raises(RetrievalError, match="cancelled") as raised:
        library.index(corpus, name="docs", cancelled=at_once)
    assert raised.value.code == "cancelled"
    late = threading.Event()  # set once every file is read: the run stops before its commit

    def progress(data):
        if data["files_done"] == data["files_total"]:
            late.set()

    with pytest.raises(RetrievalError, match="cancelled"):
        library.index(corpus, name="docs", progress=progress, cancelled=late)
    assert late.is_set()
    assert sorted(p.name for p in (tmp_path / "rag" / "docs").iterdir()) == [MANIFEST, "retriever-1"]
    assert [i["files"] for i in RagLibrary(tmp_path / "rag").list()] == [4]
    assert library.index(corpus, name="docs")["files_indexed"] == 1  # and the next run goes through


def test_a_search_during_a_reindex_sees_the_old_or_the_new_index(tmp_path):
    old = {f"f{i:03}.txt": f"apple orchard {i}\n" for i in range(150)}
    folder = write_tree(tmp_path / "docs", old)
    library = RagLibrary(tmp_path / "rag")
    library.index(folder)
    write_tree(folder, {rel: f"apple cider {i}\n" for i, rel in enumerate(old)})
    seen, errors = set(), []
    indexer = threading.Thread(target=lambda: library.index(folder))
    indexer.start()
    deadline = time.monotonic() + 120
    while (indexer.is_alive() or not seen) and time.monotonic() < deadline:
        try:
            seen.add(frozenset(p.text.split()[1] for p in library.search("apple", k=200)))
        except Exception as e:  # noqa: BLE001 (any error fails the test below)
            errors.append(e)
    indexer.join(timeout=60)
    assert not indexer.is_alive() and seen, "the index run or the searches never ended"
    assert errors == [] and seen <= {frozenset({"orchard"}), frozenset({"cider"})}
    assert {p.text.split()[1] for p in library.search("apple", k=200)} == {"cider"}


# The optional dense retriever (the `dense` extra, part of the dev extra so that CI runs this)


def test_dense_retriever_finds_paraphrases_offline(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no cached download to fall back on
    library = RagLibrary(tmp_path / "rag")
    report = library.index(corpus, name="dense", retriever="dense")
    assert (report["retriever"], report["files_indexed"]) == ("dense", 4)
    best = library.search("looking at stars through an observatory lens", k=4, name="dense")
    assert best[0].source.startswith("astronomy.md:") and -1 <= best[-1].score <= best[0].score <= 1
    assert best[0].text == lines_of(corpus, best[0].source)
    assert RagLibrary(tmp_path / "rag").search("baking in the oven", name="dense")[0].source.startswith("cooking.txt:")
    (corpus / "cooking.txt").unlink()
    assert library.index(corpus, name="dense")["files_removed"] == 1
    assert all(not p.source.startswith("cooking.txt") for p in library.search("baking in the oven", k=10, name="dense"))
    assert not (tmp_path / "home").exists()


def test_a_long_index_run_blocks_neither_listings_nor_stop(tmp_path, corpus, monkeypatch):
    """rag.index runs beside the engine; while one runs (slowed per file by a test hook), rag.list and
    skill.list answer, `ellmd stop` returns and the daemon exits; the cancelled run leaves no index."""
    big = write_tree(tmp_path / "big", {f"notes/note{i:03d}.md": f"Note {i} about topic {i % 7}.\n" for i in range(200)})
    skills = write_tree(tmp_path / "skills", {"shell/SKILL.md": "Use ls -la to list files.\n"})
    monkeypatch.setenv("ELLMD_TEST_INDEX_SLEEP", "0.25")  # 200 files: 50 s, far longer than anything below
    tmp, rag = tmp_path / "daemon", tmp_path / "rag"
    tmp.mkdir(mode=0o700)
    daemon = Daemon(tmp, slots=1, extra=["--rag-dir", str(rag), "--skills-dir", str(skills)]).start()
    try:
        with daemon.client() as client:
            assert client.rag_index(corpus, name="small")["files"] == 4
        events, outcome = [], {}

        def index_big():
            try:
                with daemon.client() as client:
                    outcome["result"] = client.rag_index(big, name="big", progress=events.append)
            except Exception as e:
                outcome["error"] = e

        worker = threading.Thread(target=index_big)
        worker.start()
        deadline = time.monotonic() + 60
        while not events:
            assert time.monotonic() < deadline and worker.is_alive(), outcome
            time.sleep(0.05)
        with daemon.client() as client:  # answered while "big" is being indexed: only "small" exists yet
            assert [(i["name"], i["files"]) for i in client.rag_indexes()] == [("small", 4)]
            assert [s["name"] for s in client.skills()] == ["shell"]
        assert worker.is_alive() and not outcome
        env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config")}
        stop = subprocess.run([sys.executable, "-m", "ellmd.cli", "stop", "--socket", str(daemon.socket)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=30)
        assert stop.returncode == 0 and "ellmd stopped" in stop.stdout, stop.stderr
        assert daemon.process.wait(timeout=30) == 0
        worker.join(30)
        assert isinstance(outcome.get("error"), Cancelled) and "shutting down" in str(outcome["error"]), outcome
        assert events[-1]["files_done"] < events[-1]["files_total"] == 200
    finally:
        if daemon.process.poll() is None:  # the test failed: leave no daemon behind
            daemon.kill()
    restarted = Daemon(tmp, slots=1, extra=["--rag-dir", str(rag), "--skills-dir", str(skills)]).start()
    try:
        with restarted.client() as client:  # "small" whole, "big" not there at all
            assert [(i["name"], i["files"]) for i in client.rag_indexes()] == [("small", 4)]
        assert not (rag / "big" / MANIFEST).exists() and not list((rag / "big").glob("retriever-*"))
    finally:
        assert restarted.stop() == 0
