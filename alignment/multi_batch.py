"""Multi batch: one batched decode over 3 slots at different lengths equals 3 separate decodes,
and equals transformers run on each sequence alone (fp32).

Slots hold 5, 17 and 33 tokens; three batched steps visit the slots in different orders
([0, 1, 2], [2, 0, 1], then the subset [2, 0]) so a slot/row mix-up cannot hide.

Shapes: decode logits [B, V], one row per slot in the order given.
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

LENGTHS = (5, 17, 33)
ORDERS = ([0, 1, 2], [2, 0, 1], [2, 0])
TOL_SAME = 1e-5  # batched vs separate decode in the engine: the same arithmetic per row


@common.kernel_paths("two-halves")  # bf16 weights held to TOL: activations in two halves (common.TOL)
def main(argv=None) -> int:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    common.torch_setup()
    report = common.Report("multi batch: batched decode == separate decodes == transformers")
    for index, name in enumerate(common.selected_variants(args)):
        path = common.checkpoint(args, name)
        reference = common.reference_model(path)
        engine = common.make_engine(path, weight_dtype=common.engine_dtype(name))
        vocab = engine.spec.vocab_size
        sequences = [common.random_tokens(n + len(ORDERS), seed=100 * index + slot, vocab=vocab) for slot, n in enumerate(LENGTHS)]
        for slot, n in enumerate(LENGTHS):
            engine.prefill(slot, sequences[slot][:n], logits="none")
        for step, order in enumerate(ORDERS):
            tokens = [sequences[slot][int(engine.lengths[slot])] for slot in order]
            separate = []
            for slot, token in zip(order, tokens):
                length = int(engine.lengths[slot])
                separate.append(engine.decode([slot], [token])[0].copy())
                engine.rewind(slot, length)
            batched = engine.decode(order, tokens).copy()  # [B, V]
            ref = np.stack(
                [common.reference_logits(reference, sequences[slot][: int(engine.lengths[slot])])[-1] for slot in order]
            )
            report.compare(f"{name}: step {step} slots {order}: batched vs separate", batched, np.stack(separate), TOL_SAME)
            report.compare(f"{name}: step {step} slots {order}: batched vs transformers", batched, ref)
        report.check(
            f"{name}: slot lengths after the steps",
            engine.lengths.tolist() == [n + sum(slot in o for o in ORDERS) for slot, n in enumerate(LENGTHS)],
            str(engine.lengths.tolist()),
        )
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
