"""`ellmd perplexity`: its windows score every token once, its NLL is the log-softmax's, and the
command prints the figure (its equality with transformers: alignment/perplexity.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ellmd import perplexity as ppl


@pytest.mark.parametrize("n, context, stride", [(10, 4, 2), (10, 4, 1), (11, 4, 3), (5, 8, 4), (1000, 128, 100)])
def test_overlapping_windows_score_every_token_after_the_first_once(n, context, stride):
    scored = [t for _, end, first in ppl.windows(n, context, stride) for t in range(first, end)]
    assert scored == list(range(1, n))
    for begin, end, first in ppl.windows(n, context, stride):
        assert end - begin <= context and first > begin and first - begin >= min(context - stride, begin)


def test_windows_without_overlap_skip_each_window_s_first_token():
    assert ppl.windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]


def test_bad_windows_are_refused():
    for context, stride in ((1, 1), (8, 0), (8, 9)):
        with pytest.raises(ValueError, match="stride"):
            ppl.windows(100, context, stride)


def test_token_nll_is_minus_the_log_softmax_of_the_target():
    logits = np.random.default_rng(0).normal(size=(3, 7)).astype(np.float32) * 5
    targets = np.array([0, 6, 3])
    expected = [-np.log(np.exp(row.astype(np.float64))[t] / np.exp(row.astype(np.float64)).sum())
                for row, t in zip(logits, targets)]
    np.testing.assert_allclose(ppl.token_nll(logits, targets), expected, rtol=1e-12)


def run(*args):
    return subprocess.run([sys.executable, "-m", "ellmd.cli", "perplexity", *args], capture_output=True, text=True, timeout=600)


def test_the_command_scores_a_text_file_and_chunking_does_not_change_it(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    results = []
    for chunk in ("64", "256"):
        done = run("--file", str(text), "--context", "128", "--stride", "64", "--chunk-size", chunk, "--json")
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout))
    assert results[0]["windows"] > 3 and results[0]["tokens_scored"] > 300
    assert 1.0 < results[0]["perplexity"] < 20  # a repeated sentence is easy to predict
    assert results[0]["perplexity"] == results[1]["perplexity"]  # one arithmetic per token, whatever the chunks


def test_bad_arguments_get_one_line():
    done = run("--context", "64", "--stride", "100")
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0 and "stride" in done.stderr
    done = run("--file", "/nonexistent/text.txt")
    assert done.returncode != 0 and "No such file" in done.stderr
