"""Incremental prefill equals full prefill: a prompt prefilled in pieces (as a session appends
turns) gives the same logits as one prefill, with a large chunk size and with a small one (7)
whose chunk boundaries fall inside and across the pieces; all of them vs transformers (fp32).

Shapes: logits [n, V] concatenated over the pieces.
"""

from __future__ import annotations

try:
    from alignment import common
except ImportError:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from alignment import common

import numpy as np

TOTAL = 45
PIECES = {"pieces 10+1+17+17": (10, 1, 17, 17), "pieces 3+9+1+16+16": (3, 9, 1, 16, 16)}
SMALL_CHUNK = 7
TOL_SAME = 1e-5  # the engine against itself: only the row blocking of the matmuls may differ


def prefill_pieces(engine, slot: int, tokens, pieces) -> np.ndarray:
    engine.rewind(slot, 0)
    out, start = [], 0
    for size in pieces:
        out.append(engine.prefill(slot, tokens[start : start + size], logits="all"))
        start += size
    assert start == len(tokens)
    return np.concatenate(out)


@common.kernel_paths("two-halves")  # bf16 weights held to TOL: activations in two halves (common.TOL)
def main(argv=None) -> int:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    common.torch_setup()
    report = common.Report("incremental prefill == full prefill == transformers")
    for index, name in enumerate(common.selected_variants(args)):
        path = common.checkpoint(args, name)
        dtype = common.engine_dtype(name)
        tokens = common.random_tokens(TOTAL + 1, seed=50 + index)
        ref = common.reference_logits(common.reference_model(path), tokens)  # [46, V]
        big = common.make_engine(path, weight_dtype=dtype, chunk_size=64)
        full = big.prefill(0, tokens[:TOTAL], logits="all")
        report.compare(f"{name}: full prefill (chunk 64) vs transformers", full, ref[:TOTAL])
        for label, pieces in PIECES.items():
            ours = prefill_pieces(big, 1, tokens[:TOTAL], pieces)
            report.compare(f"{name}: {label} (chunk 64) vs full", ours, full, TOL_SAME)
        next_full = big.decode([0], [tokens[TOTAL]])[0].copy()
        next_pieces = big.decode([1], [tokens[TOTAL]])[0].copy()
        report.compare(f"{name}: next token after pieces vs after full", next_pieces, next_full, TOL_SAME)
        report.compare(f"{name}: next token vs transformers", next_full, ref[TOTAL])

        small = common.make_engine(path, weight_dtype=dtype, chunk_size=SMALL_CHUNK)
        chunked = small.prefill(0, tokens[:TOTAL], logits="all")
        report.compare(f"{name}: full prefill (chunk {SMALL_CHUNK}) vs chunk 64", chunked, full, TOL_SAME)
        report.compare(f"{name}: full prefill (chunk {SMALL_CHUNK}) vs transformers", chunked, ref[:TOTAL])
        for label, pieces in PIECES.items():
            ours = prefill_pieces(small, 1, tokens[:TOTAL], pieces)
            report.compare(f"{name}: {label} (chunk {SMALL_CHUNK}) vs full", ours, full, TOL_SAME)
        report.compare(
            f"{name}: next token (chunk {SMALL_CHUNK}) vs transformers", small.decode([1], [tokens[TOTAL]])[0], ref[TOTAL]
        )
        small.rewind(0, 0)
        last = small.prefill(0, tokens[:TOTAL], logits="last")  # the last of 7 chunks is 3 tokens long
        report.compare(f"{name}: logits='last' (chunk {SMALL_CHUNK}) vs full", last, full[-1], TOL_SAME)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
