"""One arithmetic per token: a token's logits are the same bits whichever way it was computed (in a
prefill chunk of any size, alone in a decode step, beside other sessions, as a draft row, riding a
decode step, after a copied prefix or a resume), for float weights on every kernel path this CPU has.

The prompt crosses attention's first segment boundary (attention.SEGMENT keys), so the segments'
merge is part of what is compared.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ellmd.engine import Engine
from ellmd.kernels import attention, bf16, formats, gemm
from ellmd.kernels.matmul import linear
from ellmd.model.weights import RandomCheckpoint

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 1000, attention.SEGMENT + 76)]
OTHERS = ([11, 12, 13, 14, 15], list(range(40, 140)))  # sessions decoding beside it


def make_engine(path, weight_dtype, kv_dtype="bf16"):
    return Engine(path, weight_dtype=weight_dtype, kv_dtype=kv_dtype, sequence_length=len(PROMPT) + 8, batch_size=3,
                  chunk_size=2048, threads=2)


def prefill_in_pieces(engine, slot, tokens, size):
    """The logits of the last token, its prompt prefilled `size` tokens at a time."""
    engine.rewind(slot, 0)
    for begin in range(0, len(tokens), size):
        logits = engine.prefill(slot, tokens[begin : begin + size])
    return logits


def each_way(engine):
    """{way: logits [V] of PROMPT's last token}."""
    head, last = PROMPT[:-1], PROMPT[-1]
    ways = {"one prefill": engine.prefill(0, PROMPT).copy()}
    engine.rewind(0, 0)
    for size in (7, 64, 300):
        ways[f"chunks of {size}"] = prefill_in_pieces(engine, 0, PROMPT, size)
    prefill_in_pieces(engine, 0, PROMPT[:-20], 500)
    for token in PROMPT[-20:]:
        ways["chunks of 1 at the end"] = engine.prefill(0, [token])
    prefill_in_pieces(engine, 0, head, 256)
    ways["a decode step"] = engine.decode([0], [last])[0].copy()
    for slot, other in enumerate(OTHERS, start=1):
        prefill_in_pieces(engine, slot, other, 64)
    engine.rewind(0, len(head))
    ways["a decode step beside others"] = engine.decode([1, 0, 2], [5, last, 6])[1].copy()
    engine.rewind(0, len(head) - 2)
    ways["the last of a draft"] = engine.step([0], [PROMPT[-3:]])[0][2].copy()
    engine.rewind(0, len(head) - 2)
    engine.rewind(1, len(OTHERS[0]))
    ways["riding a decode step"] = engine.step([1], [7], extend=(0, PROMPT[-3:]), extend_logits=True)[1]
    engine.copy_slot(0, 1, len(head))  # a fork, or a shared prefix copied
    ways["after a copied prefix"] = engine.decode([1], [last])[0].copy()
    data = engine.export_kv(0, 0, len(head))  # a snapshot, resumed into another slot
    engine.rewind(2, 0)
    engine.import_kv(2, 0, data)
    ways["after a resume"] = engine.decode([2], [last])[0].copy()
    return ways


def assert_one_arithmetic(ways):
    reference = ways.pop("one prefill")
    assert np.abs(reference).max() > 0.1  # not trivially equal
    differ = {way: float(np.abs(got - reference).max()) for way, got in ways.items() if not np.array_equal(got, reference)}
    assert not differ, f"logits differ from one prefill's: {differ}"


@pytest.mark.parametrize("variant", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("weight_dtype", ["f32", "bf16", "f16"])
def test_a_tokens_logits_do_not_depend_on_how_it_was_computed(alignment_dir, variant, weight_dtype):
    assert_one_arithmetic(each_way(make_engine(alignment_dir / variant, weight_dtype)))


@pytest.mark.parametrize("kernels", ["portable", "vnni", "bf16", "bf16,bf16-round", "bf16-prefill", "dpbf16",
                                     "dpbf16,bf16-round"])
def test_on_every_kernel_path(alignment_dir, use_kernels, kernels):
    """The default paths are the test above; the float kernels are the same on the integer paths; on
    "bf16" (AMX) decode takes the tiles prefill takes, in the matmuls and in attention over bf16 KV,
    and on "dpbf16" (vdpbf16ps) the packed weights prefill takes, with activations in two halves or
    rounded once ("bf16-round").
    The prefill-only path ("bf16-prefill": AMX for GGUF blocks outside lanes' tiles) is opt-in
    because decode does not share its sums."""
    use_kernels(kernels)
    if bf16.tiles() and not bf16.decode_tiles():
        pytest.xfail("the prefill-only AMX path (two bf16 halves) does not share decode's sums")
    assert_one_arithmetic(each_way(make_engine(alignment_dir / "qwen3", "bf16")))


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0", "q4_0", "q8_0-plain", "q8_0/q4_0"])
def test_on_every_kv_dtype(alignment_dir, kv_dtype):
    """Blocks (kv_blocks.py) included: prefill and decode convert the same tiles, and rotate the
    same query rows and segment sums."""
    assert_one_arithmetic(each_way(make_engine(alignment_dir / "llama", "bf16", kv_dtype)))


@pytest.mark.parametrize("kv_dtype", ["q8_0", "q8_0-plain"])
def test_on_q8_0_blocks_of_64_values(tmp_path, kv_dtype):
    """head_dim 128 (Qwen3's): q8_0 in blocks of 64 values, keys scored in integers on int16 query
    codes and values summed from their codes, in prefill as in decode."""
    config = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(RandomCheckpoint(tmp_path / "config.json"), weight_dtype="f32", kv_dtype=kv_dtype,
                    sequence_length=len(PROMPT) + 8, batch_size=3, chunk_size=2048, threads=2)
    assert engine.kv.k.dtype.itemsize == 66  # a 64-value block
    assert_one_arithmetic(each_way(engine))


def test_the_prefill_gemm_sums_as_decode():
    """gemm.product (prefill) against matmul.linear (decode): the same bits, any width (the tail
    past the multiple of 32 included), any row count."""
    rng = np.random.default_rng(0)
    for n, m, k in [(7, 45, 40), (130, 70, 576), (65, 33, 1553), (5, 64, 8)]:
        for fmt in (formats.F32, formats.BF16, formats.F16):
            x = rng.standard_normal((n, k)).astype(np.float32)
            w = formats.to_storage(rng.standard_normal((m, k)).astype(np.float32), fmt)
            decode, prefill = np.empty((n, m), np.float32), np.empty((n, m), np.float32)
            linear(x, w, fmt, decode)
            gemm.product(x, formats.kernel_view(w, fmt), prefill, np.zeros((2, gemm.PANEL * k), np.float32))
            assert np.array_equal(prefill, decode), (n, m, k, fmt)



NORM_BOTH_PATHS = """
import sys
import numpy as np
from ellmd.kernels.activations import PARALLEL_MIN
from ellmd.kernels.norm import rmsnorm
width = int(sys.argv[1])
rows = PARALLEL_MIN // width + 40  # past PARALLEL_MIN: the prange path
rng = np.random.default_rng(width)
x, w = rng.standard_normal((rows, width)).astype(np.float32), rng.standard_normal(width).astype(np.float32)
long, short = np.empty_like(x), np.empty_like(x[:20])
rmsnorm(x, w, 1e-6, long)
rmsnorm(x[:20], w, 1e-6, short)  # below it: the serial path
print(int((long[:20] != short).any(axis=1).sum()))
"""


@pytest.mark.parametrize("width", [96, 576])
def test_a_rows_norm_is_the_same_in_a_long_chunk_and_a_short_one(tmp_path, width):
    """rmsnorm's parallel path (a chunk of PARALLEL_MIN / width rows or more) and its serial one (a
    short chunk, a decode step) give a row the same bits when both compile in one process, as on a
    first start: summed with reassoc, every row differed there (and agreed on a cache loaded from
    disk). A subprocess with a kernel cache of its own compiles them."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    if os.environ.get("NUMBA_CACHE_DIR"):
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    result = subprocess.run([sys.executable, "-c", NORM_BOTH_PATHS, str(width)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0"], "rows whose norm differs between the two paths"

# ---- over HTTP, the real daemon -------------------------------------------------------------

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a chess game", "a river town",
          "an old violin", "a night train", "a beekeeper", "a desert well"]


@pytest.fixture(scope="module", params=["bf16", "as shipped"])
def smol(request, tmp_path_factory):
    """The built-in SmolLM2 with its weights as bf16 (the float kernels), or as shipped (Q4_1 and
    Q8_0: on the int16 path, tiles with outputs in lanes, kernels/lanes.py)."""
    from test_http import start_daemon

    extra = ["--weight-dtype", "bf16"] if request.param == "bf16" else []
    daemon, port = start_daemon(tmp_path_factory.mktemp("arith"), slots=2, extra=extra)
    yield port
    assert daemon.stop() == 0


def ask(client, topic):
    """A greedy question whose own tokens (> 64: the prefill GEMM's rows) no other prompt shares."""
    system = f"You write about {topic}. " + "Keep every answer short, concrete and vivid, and never use lists. " * 5
    return client.chat.completions.create(
        model="smol", max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Two sentences about {topic}."}])


def test_the_same_greedy_request_twice_gives_the_same_text_and_logprobs(smol):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{smol}/v1", api_key="none", max_retries=0)
    for topic in TOPICS:
        first, second = ask(client, topic), ask(client, topic)
        assert first.usage.prompt_tokens > 64 + 20
        # the second is served from the first's prompt: all but its last token shared, that one alone
        assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
        assert second.choices[0].message.content == first.choices[0].message.content, topic
        steps = [[(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in r.choices[0].logprobs.content]
                 for r in (first, second)]
        assert steps[1] == steps[0], topic


def _jit_options(decorator, tree) -> dict:
    """The options an njit or overload decorator sets (an overload's jit_options, inline or a module
    constant), by name."""
    options = {k.arg: k.value for k in decorator.keywords}
    jit_options = options.get("jit_options")
    if isinstance(jit_options, ast.Name):
        jit_options = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                           and ast.unparse(n.targets[0]) == jit_options.id)
    return options if jit_options is None else {k.value: v for k, v in zip(jit_options.keys, jit_options.values)}


def test_every_kernel_names_its_fastmath_flags():
    """numba compiles a function that leaves fastmath unset with the flags of the first compiled
    caller to reach it, and caches that: its sums would then depend on which kernel happened to compile
    it first (a q8_0 KV quantizer called from a fastmath layer divided by a reciprocal, as gguf does
    not). So every njit function and overload in the kernels sets fastmath itself."""
    unset = []
    for path in sorted(Path(attention.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        unset += [f"{path.name}:{node.lineno} {node.name}" for node in ast.walk(tree)
                  for decorator in getattr(node, "decorator_list", ())
                  if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).split(".")[-1] in ("njit", "overload")
                  and "fastmath" not in _jit_options(decorator, tree)]
    assert not unset, unset
