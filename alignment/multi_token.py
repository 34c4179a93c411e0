"""Multi token: a 40-token prefill (logits at every position) and 8 decode steps after it vs
transformers' logits over the whole 48-token sequence (fp32), for every tiny checkpoint variant.

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


def main(argv=None) -> int:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
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
        report.check(
            f"{name}: greedy picks along the sequence",
            bool(np.array_equal(np.concatenate([logits, steps]).argmax(-1), ref.argmax(-1))),
            "argmax equal at every position",
        )
        engine.rewind(0, 0)
        last = engine.prefill(0, tokens[:PROMPT], logits="last")
        report.compare(f"{name}: prefill, last logits only", last, ref[PROMPT - 1])
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
