"""Multi token: a 40-token prefill (logits at every position) and 8 decode steps after it vs
transformers' logits over the whole 48-token sequence (fp32), for every tiny checkpoint variant.

Long context too: 1100 tokens prefilled in chunks of 256 (many key tiles and query blocks in
prefill attention), then decode steps at ~1100 keys (the parallel split-K decode path), batched
with a short slot, vs transformers on each sequence.

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

import numpy as np

PROMPT, STEPS = 40, 8
LONG, SHORT, LONG_STEPS, LONG_CHUNK = 1100, 7, 3, 256


def long_context(report, name, path, index) -> None:
    engine = common.make_engine(
        path, weight_dtype=common.engine_dtype(name), sequence_length=LONG + LONG_STEPS, batch_size=2, chunk_size=LONG_CHUNK
    )
    long = common.random_tokens(LONG + LONG_STEPS, seed=20 + index, vocab=engine.spec.vocab_size)
    short = common.random_tokens(SHORT + LONG_STEPS, seed=40 + index, vocab=engine.spec.vocab_size)
    reference = common.reference_model(path)
    ref_long, ref_short = common.reference_logits(reference, long), common.reference_logits(reference, short)
    logits = engine.prefill(0, long[:LONG], logits="all")  # [1100, V]
    report.compare(f"{name}: prefill {LONG} tokens (chunks of {LONG_CHUNK})", logits, ref_long[:LONG])
    engine.prefill(1, short[:SHORT], logits="none")
    steps = np.stack([engine.decode([0, 1], [long[LONG + i], short[SHORT + i]]).copy() for i in range(LONG_STEPS)])
    report.compare(f"{name}: {LONG_STEPS} decode steps at {LONG} keys", steps[:, 0], ref_long[LONG:])
    report.compare(f"{name}:   the short slot batched with it", steps[:, 1], ref_short[SHORT:])


@common.kernel_paths("two-halves")  # bf16 weights held to TOL: activations in two halves (common.TOL)
def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--no-long", action="store_true", help="skip the 1100-token case")
    args = p.parse_args(argv)
    common.torch_setup()
    report = common.Report("multi token vs transformers")
    for index, name in enumerate(common.selected_variants(args)):
        path = common.checkpoint(args, name)
        engine = common.make_engine(path, weight_dtype=common.engine_dtype(name))
        tokens = common.random_tokens(PROMPT + STEPS, seed=10 + index, vocab=engine.spec.vocab_size)
        ref = common.reference_logits(common.reference_model(path), tokens)  # [48, V]

        logits = engine.prefill(0, tokens[:PROMPT], logits="all")  # [40, V]
        report.compare(f"{name}: prefill {PROMPT} tokens, all logits", logits, ref[:PROMPT])
        steps = np.stack([engine.decode([0], [t])[0].copy() for t in tokens[PROMPT:]])  # [8, V]
        report.compare(f"{name}: {STEPS} decode steps after it", steps, ref[PROMPT:])
        differ = int((np.concatenate([logits, steps]).argmax(-1) != ref.argmax(-1)).sum())
        report.check(f"{name}: greedy picks along the sequence", differ == 0, f"argmax differs at {differ} of {len(ref)} positions")
        engine.rewind(0, 0)
        last = engine.prefill(0, tokens[:PROMPT], logits="last")
        report.compare(f"{name}: prefill, last logits only", last, ref[PROMPT - 1])
        if not args.no_long:
            long_context(report, name, path, index)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
