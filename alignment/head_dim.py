"""head_dim 12, 40 and 80 (not multiples of the attention kernels' SIMD width of 16, but for 80)
vs transformers (fp32), Llama and Qwen3: one token, multi token, incremental prefill, long context.

Each check writes a tiny random checkpoint of alignment/checkpoints.py's shape (6 query heads
over 2 KV heads, GQA) with the head_dim changed, f32 weights and f32 KV, and compares:
  one token      a one-token prefill and a one-token decode into an empty slot
  multi token    a 40-token prefill (all logits), 8 decode steps after it, greedy picks
  incremental    the prompt prefilled in pieces, chunk size 64 and 7, then the next token
  long context   1100 tokens in chunks of 256 (many key tiles), 3 decode steps at ~1100 keys
                 (the parallel split-K decode path) batched with a short slot

    python alignment/head_dim.py --dir /tmp/ellm-ckpts --head-dim 40 --family qwen3

Shapes: logits [n, V].
"""

from __future__ import annotations

try:
    from alignment import common
except ImportError:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from alignment import common

import json
import os
import shutil
from pathlib import Path

import numpy as np

HEAD_DIMS = (12, 40, 80)
FAMILIES = ("llama", "qwen3")
PROMPT, STEPS = 40, 8
PIECES = (10, 1, 17, 12)
SMALL_CHUNK = 7
LONG, SHORT, LONG_STEPS, LONG_CHUNK = 1100, 7, 3, 256
TOL_SAME = 1e-5  # the engine against itself: only the row blocking of the matmuls may differ


def checkpoint(root: Path, family: str, head_dim: int) -> Path:
    """A tiny random checkpoint of `family` with `head_dim`, written on first use under root."""
    import torch
    import transformers

    from alignment import checkpoints

    directory = Path(root) / f"head_dim-{family}-{head_dim}"
    stamp = json.dumps({"family": family, "head_dim": head_dim, "shape": checkpoints.SHAPE}, sort_keys=True)
    done = directory / checkpoints.DONE
    if done.exists() and done.read_text() == stamp:
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    classes = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}
    config = classes[family](**dict(checkpoints.SHAPE, head_dim=head_dim, tie_word_embeddings=False))
    torch.manual_seed(head_dim)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    checkpoints.randomize(model, seed=head_dim)
    model.save_pretrained(directory)
    for file in checkpoints.TOKENIZER_DIR.iterdir():
        shutil.copy(file, directory / file.name)
    done.write_text(stamp)
    return directory


def one_token(report, tag, path, reference) -> None:
    engine = common.make_engine(path)
    vocab = engine.spec.vocab_size
    for token in (0, vocab - 1, *common.random_tokens(2, seed=1, vocab=vocab)):
        ref = common.reference_logits(reference, [token])[0]
        engine.rewind(0, 0)
        report.compare(f"{tag}: one token, prefill [{token}]", engine.prefill(0, [token]), ref)
        engine.rewind(0, 0)
        report.compare(f"{tag}: one token, decode  [{token}]", engine.decode([0], [token])[0], ref)


def multi_token(report, tag, path, reference, seed) -> None:
    engine = common.make_engine(path)
    tokens = common.random_tokens(PROMPT + STEPS, seed=seed)
    ref = common.reference_logits(reference, tokens)  # [48, V]
    logits = engine.prefill(0, tokens[:PROMPT], logits="all")
    report.compare(f"{tag}: prefill {PROMPT} tokens, all logits", logits, ref[:PROMPT])
    steps = np.stack([engine.decode([0], [t])[0].copy() for t in tokens[PROMPT:]])
    report.compare(f"{tag}: {STEPS} decode steps after it", steps, ref[PROMPT:])
    differ = int((np.concatenate([logits, steps]).argmax(-1) != ref.argmax(-1)).sum())
    report.check(f"{tag}: greedy picks along the sequence", differ == 0, f"argmax differs at {differ} of {len(ref)} positions")


def incremental(report, tag, path, reference, seed) -> None:
    total = sum(PIECES)
    tokens = common.random_tokens(total + 1, seed=seed)
    ref = common.reference_logits(reference, tokens)
    for chunk in (64, SMALL_CHUNK):
        engine = common.make_engine(path, chunk_size=chunk)
        full = engine.prefill(0, tokens[:total], logits="all")
        report.compare(f"{tag}: full prefill (chunk {chunk})", full, ref[:total])
        start, pieces = 0, []
        for size in PIECES:
            pieces.append(engine.prefill(1, tokens[start : start + size], logits="all"))
            start += size
        report.compare(f"{tag}: pieces {'+'.join(map(str, PIECES))} (chunk {chunk}) vs full", np.concatenate(pieces), full, TOL_SAME)
        report.compare(f"{tag}: next token after the pieces (chunk {chunk})", engine.decode([1], [tokens[total]])[0], ref[total])


def long_context(report, tag, path, reference, seed) -> None:
    engine = common.make_engine(path, sequence_length=LONG + LONG_STEPS, batch_size=2, chunk_size=LONG_CHUNK)
    long = common.random_tokens(LONG + LONG_STEPS, seed=seed)
    short = common.random_tokens(SHORT + LONG_STEPS, seed=seed + 1)
    ref_long, ref_short = common.reference_logits(reference, long), common.reference_logits(reference, short)
    report.compare(f"{tag}: prefill {LONG} tokens (chunks of {LONG_CHUNK})", engine.prefill(0, long[:LONG], logits="all"), ref_long[:LONG])
    engine.prefill(1, short[:SHORT], logits="none")
    steps = np.stack([engine.decode([0, 1], [long[LONG + i], short[SHORT + i]]).copy() for i in range(LONG_STEPS)])
    report.compare(f"{tag}: {LONG_STEPS} decode steps at {LONG} keys", steps[:, 0], ref_long[LONG:])
    report.compare(f"{tag}:   the short slot batched with it", steps[:, 1], ref_short[SHORT:])


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.add_argument("--dir", default=os.environ.get(common.DEFAULT_DIR_ENV), help="checkpoint cache directory")
    p.add_argument("--head-dim", type=int, action="append", choices=HEAD_DIMS, help="default: all")
    p.add_argument("--family", action="append", choices=FAMILIES, help="default: all")
    p.add_argument("--no-long", action="store_true", help="skip the 1100-token case")
    args = p.parse_args(argv)
    common.torch_setup()
    root = Path(args.dir) if args.dir else common._temporary_root()
    report = common.Report("head_dim 12 / 40 / 80 vs transformers")
    for family in args.family or FAMILIES:
        for index, head_dim in enumerate(args.head_dim or HEAD_DIMS):
            path = checkpoint(root, family, head_dim)
            reference = common.reference_model(path)
            tag = f"{family} head_dim {head_dim}"
            one_token(report, tag, path, reference)
            multi_token(report, tag, path, reference, seed=60 + index)
            incremental(report, tag, path, reference, seed=70 + index)
            if not args.no_long:
                long_context(report, tag, path, reference, seed=80 + index)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
