"""The engine over slots: no allocation in decode, slot operations, sampling, loading errors, the CLI."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ellmd.engine import Engine, SamplingParams
from ellmd.engine.sampling import Sampler
from ellmd.errors import CapacityError, InvariantError, ModelError
from ellmd.kernels.bf16 import is_packed
from ellmd.model.weights import RandomCheckpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(alignment_dir):
    return alignment_dir / "llama"


@pytest.fixture(scope="module")
def engine(llama):
    return Engine(llama, weight_dtype="bf16", kv_dtype="bf16", sequence_length=128, batch_size=3, chunk_size=16, threads=2)


def test_decode_allocates_no_arrays(tmp_path):
    """A decode step only uses the plan's buffers: the traced peak stays below one activation row."""
    config = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 2048, "intermediate_size": 4096,
              "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(RandomCheckpoint(tmp_path / "config.json"), sequence_length=64, batch_size=2, chunk_size=8)
    engine.prefill(0, [1, 2, 3])
    engine.prefill(1, [4, 5])
    slots, tokens = [0, 1], [7, 8]
    engine.decode(slots, tokens)
    row_bytes = config["hidden_size"] * 4  # the smallest activation a decode step could allocate
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(3):
            engine.decode(slots, tokens)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < row_bytes // 2, f"decode allocated {peak} bytes"


def test_batched_decode_equals_separate_decodes(engine):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    for slot, prompt in enumerate(prompts):
        engine.rewind(slot, 0)
        engine.prefill(slot, prompt)
    batched = engine.decode([0, 1, 2], [1, 2, 3]).copy()
    for slot, token in zip(range(3), (1, 2, 3)):
        engine.rewind(slot, len(prompts[slot]))
        alone = engine.decode([slot], [token])[0]
        np.testing.assert_allclose(batched[slot], alone, atol=1e-4 * np.abs(alone).max())
    assert list(engine.lengths) == [len(p) + 1 for p in prompts]


@pytest.mark.parametrize("kernels", ["portable", "default"])
def test_a_prefill_riding_a_decode_step_matches_both_apart(llama, use_kernels, kernels):
    use_kernels(kernels)  # before the load: where decode runs on AMX tiles, bf16 weights are packed for them
    engine = Engine(llama, weight_dtype="bf16", kv_dtype="bf16", sequence_length=128, batch_size=3, chunk_size=16, threads=2)
    a, b = [5, 6, 7, 8, 9], list(range(20, 32))
    engine.rewind(0, 0)
    engine.prefill(0, a)
    engine.rewind(1, 0)
    engine.prefill(1, b[:4])
    decode_alone = engine.decode([0], [1])[0].copy()
    extend_alone = engine.prefill(1, b[4:], logits="last")
    after_alone = engine.decode([1], [2])[0].copy()  # reads the KV the prefill wrote
    engine.rewind(0, len(a))
    engine.rewind(1, 4)
    logits, last = engine.step([0], [1], extend=(1, b[4:]), extend_logits=True)
    logits = logits[0].copy()  # a view of the workspace, which the next decode overwrites
    assert list(engine.lengths[:2]) == [len(a) + 1, len(b)]
    assert np.array_equal(logits, decode_alone)  # the decoding session's numbers, to the bit
    # the riding tokens attend as decode rows do, the prefill alone through the tiled prefill
    # kernel (the same products; measured 1.8e-4 of the logits' range when their sums were ordered apart)
    for got, want in ((last, extend_alone), (engine.decode([1], [2])[0], after_alone)):
        np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max())
    lengths = list(engine.lengths)
    with pytest.raises(InvariantError, match="not decoding"):  # the runtime's bug, not a request's
        engine.step([0], [1], extend=(0, [3]))
    with pytest.raises(InvariantError, match="more tokens"):
        engine.step([0], [1], extend=(1, [3] * engine.step_rows))
    with pytest.raises(InvariantError):  # more rows than a step takes (and over the sequence length)
        engine.step([0], [1], extend=(1, [3] * (128 - len(b) + 1)))
    assert list(engine.lengths) == lengths  # a refused step changes nothing


def test_rewind_copy_export_import(engine):
    tokens = list(range(3, 40))
    engine.rewind(0, 0)
    engine.prefill(0, tokens)
    expected = engine.decode([0], [41])[0].copy()
    engine.rewind(0, len(tokens))
    assert engine.lengths[0] == len(tokens)

    engine.copy_slot(0, 1)
    np.testing.assert_array_equal(engine.decode([1], [41])[0], expected)

    data = engine.export_kv(0, 0, len(tokens))
    assert len(data) == len(tokens) * engine.kv.bytes_per_token
    engine.rewind(2, 0)
    engine.import_kv(2, 0, data)
    np.testing.assert_array_equal(engine.decode([2], [41])[0], expected)

    with pytest.raises(InvariantError):
        engine.rewind(0, 10_000)
    with pytest.raises(CapacityError):
        engine.prefill(0, [1] * 200)  # over the 128-token sequence length
    with pytest.raises(InvariantError):
        engine.prefill(0, [10**6])  # outside the vocabulary (requests are checked before)


def test_chunked_prefill_matches_one_forward(llama):
    engine = Engine(llama, weight_dtype="f32", kv_dtype="f32", sequence_length=128, batch_size=1, chunk_size=64)
    tokens = list(np.random.default_rng(1).integers(0, 1000, 50))
    whole = engine.prefill(0, tokens, logits="all")
    small = Engine(llama, weight_dtype="f32", kv_dtype="f32", sequence_length=128, batch_size=1, chunk_size=7)
    pieces = np.concatenate([small.prefill(0, tokens[:20], logits="all"), small.prefill(0, tokens[20:], logits="all")])
    np.testing.assert_allclose(pieces, whole, atol=1e-4 * np.abs(whole).max())


def test_sampling_is_reproducible_with_a_seed():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123)
    draws = [Sampler(params)(logits) for _ in range(2)]
    assert draws[0] == draws[1]
    many = Sampler(SamplingParams(temperature=1.0, seed=5))
    assert len({many(logits) for _ in range(50)}) > 5  # it really samples
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=9))(logits) == int(np.argmax(logits))
    top = np.argsort(-logits)[:3]
    assert all(Sampler(SamplingParams(temperature=2.0, top_k=3, seed=s))(logits) in top for s in range(20))


def test_penalties_and_bias_change_the_choice():
    logits = np.array([1.0, 3.0, 2.0], np.float32)
    assert Sampler(SamplingParams())(logits) == 1
    assert Sampler(SamplingParams(logit_bias={0: 5.0}))(logits) == 0
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt_tokens=[1])(logits) == 2
    sampler = Sampler(SamplingParams(frequency_penalty=1.5))
    sampler.accept(1)
    assert sampler(logits) == 2


def test_sampling_params_are_validated():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"min_p": 2}, {"max_tokens": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_generate_stops_at_eos_and_max_tokens(engine):
    engine.rewind(0, 0)
    tokens = list(engine.generate(0, [3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True)))
    assert len(tokens) == 5
    first = tokens[0]
    engine.rewind(0, 0)
    stopped = list(engine.generate(0, [3, 4, 5], SamplingParams(max_tokens=5, stop_token_ids=[first])))
    assert stopped == [first]


def test_weights_keep_their_precision(alignment_dir):
    bf16 = alignment_dir / "qwen3-yarn-bf16"
    engine = Engine(bf16, kv_dtype="bf16", sequence_length=16, chunk_size=8)
    assert engine.fmt == 1  # bf16, as stored
    qkv = engine.model.layers[0]["qkv_proj"]
    assert qkv.dtype == np.uint16 or is_packed(qkv)  # bf16 bits, packed as AMX tiles where decode takes them
    assert Engine(bf16, weight_dtype="f32", sequence_length=16, chunk_size=8).model.layers[0]["qkv_proj"].dtype == np.float32


def test_the_kernels_operands_start_cache_lines(engine):
    """Weights, KV and every work buffer on 64-byte boundaries (aligned.py): a tile row or vector
    load across two lines costs two, and numpy's own buffers start 16 bytes into one."""
    from ellmd.engine.plan import _arrays

    arrays = [w for layer in engine.model.layers for w in layer.values() if w.ndim == 2]
    arrays += [engine.kv.k, engine.kv.v, *(a for a in _arrays(engine.plan.ws) if a.size)]  # (nothing to load in none)
    assert len(arrays) > 20
    assert [a.ctypes.data % 64 for a in arrays] == [0] * len(arrays)


def test_kv_budget_over_memory_is_refused(llama):
    with pytest.raises(CapacityError, match="KV cache needs"):
        Engine(llama, sequence_length=1 << 30, batch_size=64)


def broken_checkpoints(llama: Path, tmp: Path):
    """(path, expected words in the message) for each kind of bad model input."""
    cases = []
    missing = tmp / "nothing-here"
    cases.append((missing, "no such file"))

    no_config = tmp / "no-config"
    shutil.copytree(llama, no_config)
    (no_config / "config.json").unlink()
    cases.append((no_config, "config.json"))

    bad_type = tmp / "bad-type"
    shutil.copytree(llama, bad_type)
    config = json.loads((bad_type / "config.json").read_text())
    (bad_type / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    cases.append((bad_type, "unsupported model_type"))

    wrong_shape = tmp / "wrong-shape"
    shutil.copytree(llama, wrong_shape)
    (wrong_shape / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    cases.append((wrong_shape, "shape"))

    truncated = tmp / "truncated"
    shutil.copytree(llama, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases.append((truncated, "truncated"))

    garbage = tmp / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    cases.append((garbage, "garbage.gguf"))

    not_gguf = tmp / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 128)
    cases.append((not_gguf, "not a GGUF"))
    return cases


def test_bad_model_inputs_get_one_clear_line(llama, tmp_path):
    for path, words in broken_checkpoints(llama, tmp_path):
        with pytest.raises(ModelError, match=words):
            Engine(path, sequence_length=16, chunk_size=8)
    # and through the CLI: one line on stderr, a non-zero exit, no traceback
    path, words = broken_checkpoints(llama, tmp_path / "cli")[3]
    result = subprocess.run([sys.executable, "-m", "ellmd.cli", "generate", "-p", "hi", "--model-path", str(path)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert words in result.stderr.strip().splitlines()[-1]


OUT_OF_RANGE = [  # (config.json field, value, the rule the error must state)
    ("num_hidden_layers", -2, "must be an integer >= 1"), ("num_attention_heads", 0, "must be an integer >= 1"),
    ("num_key_value_heads", 5, "must divide num_attention_heads ("),
    ("vocab_size", 0, "must be an integer >= 1"), ("hidden_size", 2.5, "must be an integer >= 1"),
    ("intermediate_size", "big", "must be an integer >= 0"), ("rms_norm_eps", -1, "must be a number in (0, 1)"),
    ("rope_theta", 0, "must be a finite number > 0"), ("max_position_embeddings", 0, "must be an integer >= 1"),
    ("eos_token_id", [10 ** 9], "must be token ids in [0, "), ("bos_token_id", -1, "must be a token id in [0, "),
    ("tie_word_embeddings", "yes", "must be true or false"), ("rope_scaling", {"factor": -2}, "factor is a number > 0"),
]


def test_every_config_field_out_of_range_gets_one_line_naming_it(llama, tmp_path):
    """num_hidden_layers -2 and num_attention_heads 0 used to end in 40-50-line tracebacks."""
    config = json.loads((llama / "config.json").read_text())
    for name, value, rule in OUT_OF_RANGE:
        broken = tmp_path / name
        shutil.copytree(llama, broken)
        (broken / "config.json").write_text(json.dumps({**config, name: value}))
        with pytest.raises(ModelError) as error:
            Engine(broken, sequence_length=16, chunk_size=8)
        assert str(error.value).startswith(f"config.json: {name} = {value!r}: "), str(error.value)
        assert rule in str(error.value)
    # and the daemon refuses to start with that one line, no traceback
    for name in ("num_hidden_layers", "num_attention_heads"):
        result = subprocess.run([sys.executable, "-m", "ellmd.cli", "start", "--model-path", str(tmp_path / name),
                                 "--socket", str(tmp_path / "run" / "ellmd.sock"), "--store", str(tmp_path / "store")],
                                capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert f"config.json: {name} = " in result.stderr.strip().splitlines()[-1]


def test_gguf_metadata_out_of_range_gets_one_line_naming_it():
    from ellmd.model.spec import ModelSpec

    fields = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
              "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.vocab_size": 256}
    assert ModelSpec.from_gguf(fields).head_dim == 16
    for key, value, words in [("llama.block_count", 0, "block_count (ellm's num_hidden_layers) = 0: must be an integer >= 1"),
                              ("llama.attention.head_count", 0, "attention.head_count (ellm's num_attention_heads) = 0"),
                              ("llama.attention.head_count_kv", 3, "must divide num_attention_heads (4)"),
                              ("llama.rope.freq_base", -1.0, "rope.freq_base (ellm's rope_theta) = -1.0"),
                              ("tokenizer.ggml.eos_token_id", 999, "must be token ids in [0, 256)"),
                              ("llama.embedding_length", None, "llama.embedding_length is missing"),
                              ("llama.block_count", "two", "a value of the wrong type")]:
        with pytest.raises(ModelError, match=re.escape(words)):
            ModelSpec.from_gguf({**fields, key: value})



def test_a_gguf_index_is_parsed_once_then_read_from_its_cache(tmp_path, monkeypatch):
    """The gguf package parses a file's metadata and tensor table once; later opens decode the cached
    index, and a file written anew is parsed anew."""
    import gguf

    from ellmd.model.weights import gguf_index

    def write(name):
        writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
        writer.add_name(name)
        writer.add_tensor("output_norm.weight", np.arange(8, dtype=np.float32))
        writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parsed, parse = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args: parsed.append(args) or parse(*args))
    write("first")
    index = gguf_index(tmp_path / "model.gguf")
    assert gguf_index(tmp_path / "model.gguf") == index and len(parsed) == 1
    assert index.fields["general.name"] == "first"
    reader = parse(tmp_path / "model.gguf")
    assert [(t.name, t.kind, t.dims, t.nbytes) for t in index.tensors] == [
        ("output_norm.weight", "F32", [8], 32), ("token_embd.weight", "F16", [32, 4], 256)]
    assert [t.offset for t in index.tensors] == [t.data_offset for t in reader.tensors]
    write("second, a longer name")
    assert gguf_index(tmp_path / "model.gguf").fields["general.name"] == "second, a longer name"
    assert len(parsed) == 2


def test_a_big_endian_gguf_gets_one_line(tmp_path):
    import gguf

    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("output_norm.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="big-endian GGUF file"):
        Engine(path, sequence_length=16, chunk_size=8)

def test_generate_json_on_the_builtin_model():
    result = subprocess.run(
        [sys.executable, "-m", "ellmd.cli", "generate", "-p", "What is the capital of France?", "--max-tokens", "12",
         "--json", "--threads", "2"], capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt_token_ids"][:1] == [1]  # <|im_start|>: the chat template was applied
    assert 0 < len(out["token_ids"]) <= 12
    assert "Paris" in out["text"]


def test_bench_cli_on_a_synthetic_model(tmp_path):
    config = {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, "-m", "ellmd.cli", "bench", "--config", str(tmp_path / "config.json"), "--prefill", "8,32",
         "--append", "8@0,8@40", "--decode", "4", "--context", "8", "--repetitions", "2", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["test"], r["context"]) for r in rows] == [("pp8", 0), ("pp32", 0), ("pp8@0", 0), ("pp8@40", 40), ("tg4", 8)]
    assert all(r["tok_s"] > 0 and r["weight_dtype"] == "bf16" for r in rows)
    bad = subprocess.run([sys.executable, "-m", "ellmd.cli", "bench", "--config", str(tmp_path / "config.json"),
                          "--append", "8@x"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert bad.returncode != 0 and "--append: '8@x' is not N@C" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_appends_time_a_turn_on_top_of_the_held_tokens(engine, monkeypatch):
    from ellmd.bench import run_bench

    held_at_start, prefill = [], engine.prefill

    def spy(slot, tokens, logits="last"):
        held_at_start.append((int(engine.lengths[slot]), len(tokens)))
        return prefill(slot, tokens, logits)

    monkeypatch.setattr(engine, "prefill", spy)
    rows = run_bench(engine, [], 0, 0, 2, appends=[(8, 0), (8, 20)])
    assert [(r["test"], r["context"]) for r in rows] == [("pp8@0", 0), ("pp8@20", 20)]
    # (8, 0): two timed prefills on an empty slot; (8, 20): the history once, then two timed turns on top of it
    assert held_at_start == [(0, 8), (0, 8), (0, 20), (20, 8), (20, 8)]


@pytest.mark.parametrize("model", [None, "none"])
def test_a_gguf_without_a_vocabulary_loads_without_a_tokenizer(tmp_path, model):
    import gguf

    from ellmd.engine.engine import load_tokenizer
    from ellmd.model.weights import GGUFCheckpoint, gguf_index

    path = tmp_path / "no-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    if model:
        writer.add_tokenizer_model(model)  # what llama-quantize keeps of a file written without a vocabulary
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = GGUFCheckpoint.__new__(GGUFCheckpoint)  # the tokenizer needs only the file's metadata
    checkpoint.fields = gguf_index(path).fields
    assert load_tokenizer(checkpoint) is None
