"""Resumed session equals never-evicted session: a slot's KV exported as bytes (in two pieces,
as the store writes chunks), the slot evicted and overwritten by another sequence, the bytes
imported back, then the next decode steps give the same logits as a slot that never left
memory, and as transformers. A fork (copy_slot) is checked the same way. The engine must match
itself exactly, whatever the KV dtype (f32 and bf16 here); the comparison with transformers is
checked with f32 KV and only printed with bf16 KV (lossy KV is kv_dtype_report's subject).

Slots: 0 resumed, 1 never evicted, 2 forked from 1.
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

PROMPT, SPLIT, STEPS = 30, 16, 4
TOL_EXACT = 0.0  # same bytes, same arithmetic


@common.kernel_paths("two-halves")  # bf16 weights held to TOL: activations in two halves (common.TOL)
def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--kv-dtype", action="append", choices=["f32", "bf16", "f16"], help="default: f32 and bf16")
    args = p.parse_args(argv)
    common.torch_setup()
    report = common.Report("KV export/import: resumed == never evicted == transformers")
    for index, name in enumerate(common.selected_variants(args)):
        path = common.checkpoint(args, name)
        tokens = common.random_tokens(PROMPT + STEPS, seed=70 + index)
        junk = common.random_tokens(PROMPT + 5, seed=90 + index)
        ref = common.reference_logits(common.reference_model(path), tokens)  # [34, V]
        for kv_dtype in args.kv_dtype or ["f32", "bf16"]:
            tag = f"{name} kv {kv_dtype}"
            engine = common.make_engine(
                path, weight_dtype=common.engine_dtype(name), kv_dtype=kv_dtype, sequence_length=64, batch_size=3
            )
            engine.prefill(0, tokens[:PROMPT], logits="none")
            engine.prefill(1, tokens[:PROMPT], logits="none")
            pieces = [engine.export_kv(0, 0, SPLIT), engine.export_kv(0, SPLIT, PROMPT)]
            per_token = engine.kv.bytes_per_token
            report.check(
                f"{tag}: exported size", [len(b) for b in pieces] == [SPLIT * per_token, (PROMPT - SPLIT) * per_token],
                f"{sum(map(len, pieces))} bytes = {PROMPT} x {per_token}",
            )
            # Evict: the slot is reused by another sequence, longer than ours, then freed.
            engine.rewind(0, 0)
            engine.prefill(0, junk, logits="none")
            engine.rewind(0, 0)
            # Resume.
            length = engine.import_kv(0, 0, pieces[0])
            length = engine.import_kv(0, length, pieces[1])
            report.check(f"{tag}: length after import", length == PROMPT and engine.lengths[0] == PROMPT, str(length))
            report.check(
                f"{tag}: re-exported bytes", np.array_equal(engine.export_kv(0, 0, PROMPT), engine.export_kv(1, 0, PROMPT)), "identical"
            )
            engine.copy_slot(1, 2)
            resumed, never, forked = [], [], []
            for token in tokens[PROMPT:]:
                resumed.append(engine.decode([0], [token])[0].copy())
                never.append(engine.decode([1], [token])[0].copy())
                forked.append(engine.decode([2], [token])[0].copy())
            resumed, never, forked = np.stack(resumed), np.stack(never), np.stack(forked)  # [STEPS, V]
            report.compare(f"{tag}: {STEPS} steps, resumed vs never evicted", resumed, never, TOL_EXACT)
            report.compare(f"{tag}: {STEPS} steps, forked vs never evicted", forked, never, TOL_EXACT)
            if kv_dtype == "f32":
                report.compare(f"{tag}: {STEPS} steps, resumed vs transformers", resumed, ref[PROMPT:])
            else:  # lossy KV: its accuracy is kv_dtype_report's business
                report.info(f"{tag}: {STEPS} steps, resumed vs transformers", resumed, ref[PROMPT:], "lossy KV: not checked")
            batched = engine.decode([2, 0, 1], [tokens[0]] * 3).copy()  # one more step, all three in one batch
            report.compare(f"{tag}: batched step, all three slots equal", batched[[0, 1]], batched[[2, 2]], TOL_EXACT)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
