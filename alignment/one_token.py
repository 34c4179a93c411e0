"""One token: the engine's logits for a single token at position 0 vs transformers (fp32).

Both entry points: a one-token prefill and a one-token decode into an empty slot. Every tiny
checkpoint variant; f32 checkpoints run with f32 weights, bf16 ones with their native bf16
weights (transformers upcasts the same bf16 values to fp32) and again converted to f32 at load.
KV in f32.

Shapes: logits [V].
"""

from __future__ import annotations

try:
    from alignment import common
except ImportError:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from alignment import common


@common.kernel_paths("two-halves")  # bf16 weights held to TOL: activations in two halves (common.TOL)
def main(argv=None) -> int:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    common.torch_setup()
    report = common.Report("one token vs transformers")
    for name in common.selected_variants(args):
        path = common.checkpoint(args, name)
        reference = common.reference_model(path)
        # bf16 checkpoints: native bf16 weights, and converted to f32 at load.
        for weight_dtype in dict.fromkeys([common.engine_dtype(name), "f32"]):
            engine = common.make_engine(path, weight_dtype=weight_dtype)
            tag = f"{name} ({weight_dtype or 'native bf16'} weights)"
            vocab = engine.spec.vocab_size
            for token in (0, vocab - 1, *common.random_tokens(2, seed=1, vocab=vocab)):
                ref = common.reference_logits(reference, [token])[0]
                engine.rewind(0, 0)
                report.compare(f"{tag}: prefill [{token}]", engine.prefill(0, [token]), ref)
                engine.rewind(0, 0)
                report.compare(f"{tag}: decode  [{token}]", engine.decode([0], [token])[0], ref)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
