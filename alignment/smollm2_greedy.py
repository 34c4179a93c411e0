"""SmolLM2-135M-Instruct (the built-in Q4_1 GGUF): ellm with f32 weights and f32 KV vs
transformers fp32 loaded from the same GGUF (both dequantize the same Q4_1 blocks).

For each chat prompt, rendered by the model's chat template with the generation prompt:
  - the prompt ids: the engine's own template + tokenizer vs transformers' apply_chat_template;
  - the greedy continuation of up to 32 tokens: ellm's generate() vs transformers'
    generate(do_sample=False) must be IDENTICAL token ids;
  - the logits of every prompt position (prefill) and of every decode step that generate() ran,
    vs one transformers forward over prompt + continuation;
  - the greedy continuation with bf16 KV (the default) and with q8_0 KV, same weights, must each
    be IDENTICAL to transformers' (f32 KV there) or part from it only at a near tie: where the
    reference's top two logits are closer than the logit tolerance (TOL x the largest logit), which
    either KV format may round either way (bf16 KV on AMX rounds its probabilities to bf16).

Shapes: logits [n, V], V = 49152.
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

NEW_TOKENS = 32
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Hi! My name is Ada."},
        {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
        {"role": "user", "content": "Give me three ideas for a weekend trip."},
    ],
    [{"role": "user", "content": "Translate to French: 'The cat sleeps on the warm windowsill.'"}],
    [{"role": "user", "content": "List the first ten prime numbers, separated by commas."}],
]


class Recorder:
    """Keeps the logits of every position while engine.generate() runs, without changing it.

    prefill is asked for all positions (generate only needs the last) and decode rows are
    copied as they come: one pass gives the prompt logits, the decode logits and the ids.
    """

    def __init__(self, engine):
        self.engine, self.logits = engine, []
        self._prefill, self._decode = engine.prefill, engine.decode

    def __enter__(self):
        self.engine.prefill, self.engine.decode = self.prefill, self.decode
        return self

    def __exit__(self, *exc):
        del self.engine.prefill, self.engine.decode  # back to the class's methods

    def prefill(self, slot, tokens, logits="last"):
        rows = self._prefill(slot, tokens, logits="all")  # [P, V]
        self.logits.append(rows)
        return rows[-1].copy() if logits == "last" else rows

    def decode(self, slots, tokens):
        rows = self._decode(slots, tokens)  # [1, V]
        self.logits.append(rows.copy())
        return rows


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to run")
    args = p.parse_args(argv)
    common.torch_setup()
    from ellmd.engine import SamplingParams, builtin_model_path
    from ellmd.text import ChatTemplate

    path = builtin_model_path()
    report = common.Report(f"SmolLM2-135M-Instruct ({path.name}) greedy vs transformers")
    reference = common.reference_model(path)
    tokenizer = common.reference_tokenizer(path)
    engine = common.make_engine(path, weight_dtype="f32", kv_dtype="f32", sequence_length=256, chunk_size=64)
    kv_engines = {kv: common.make_engine(path, weight_dtype="f32", kv_dtype=kv, sequence_length=256, chunk_size=64)
                  for kv in ("bf16", "q8_0")}
    template = ChatTemplate.from_tokenizer(engine.tokenizer)
    eos = sorted(set(engine.spec.eos_token_id))
    report.note(f"eos ids: engine {eos}, transformers {reference.generation_config.eos_token_id}")

    for index, messages in enumerate(PROMPTS[: args.prompts]):
        tag = f"prompt {index}"
        ids = common.chat_ids(tokenizer, messages, add_generation_prompt=True)
        ours_ids = engine.tokenizer.encode(template.render(messages, add_generation_prompt=True))
        report.check(f"{tag}: prompt ids (ellm template+tokenizer)", ours_ids == ids, f"{len(ids)} tokens")

        ref_tokens = common.reference_greedy(reference, ids, NEW_TOKENS, eos_token_id=eos)
        engine.rewind(0, 0)
        with Recorder(engine) as recorder:
            tokens = list(engine.generate(0, ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)))
        logits = np.concatenate(recorder.logits)  # [P + N - 1, V]
        ref_logits = common.reference_logits(reference, ids + tokens[:-1])  # [P + N - 1, V]
        report.compare(f"{tag}: prompt logits ({len(ids)} positions)", logits[: len(ids)], ref_logits[: len(ids)])
        report.compare(f"{tag}: decode logits ({len(tokens) - 1} steps)", logits[len(ids) :], ref_logits[len(ids) :])
        report.check(f"{tag}: greedy tokens, generate()", tokens == ref_tokens, _diverge(tokens, ref_tokens, ref_logits, len(ids)))
        by_kv = {}
        for kv, kv_engine in kv_engines.items():
            kv_engine.rewind(0, 0)
            by_kv[kv] = list(kv_engine.generate(0, ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)))
        vs_reference = "; ".join(f"{kv} KV vs transformers: {_diverge(t, ref_tokens, ref_logits, len(ids))}" for kv, t in by_kv.items())
        report.check(f"{tag}: greedy tokens, bf16 and q8_0 KV", all(
            _at_near_tie(t, ref_tokens, ref_logits, len(ids)) for t in by_kv.values()), vs_reference)
        report.note(f"{tag}: {tokenizer.decode(ref_tokens)!r}")
    return report.exit_code()


def _parting(ours, ref, ref_logits, prompt_len) -> tuple:
    """(at, margin, largest): the first token where ours parts from ref, and there the reference's
    top-2 logit margin and largest |logit| (None, None past the reference's logits)."""
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    row = prompt_len - 1 + at
    if row >= len(ref_logits):
        return at, None, None
    top = np.sort(ref_logits[row])[-2:]
    return at, top[1] - top[0], np.abs(ref_logits[row]).max()


def _at_near_tie(ours, ref, ref_logits, prompt_len) -> bool:
    """ours == ref, or the first token where they part is one whose reference top-2 margin is
    within the logit tolerance."""
    if ours == ref:
        return True
    _, margin, largest = _parting(ours, ref, ref_logits, prompt_len)
    return margin is not None and margin <= common.TOL * largest


def _diverge(ours, ref, ref_logits, prompt_len) -> str:
    if ours == ref:
        return f"{len(ref)} identical tokens"
    at, margin, _ = _parting(ours, ref, ref_logits, prompt_len)
    detail = f"diverge at token {at} of {len(ref)} (ours {ours[at:at + 3]}, reference {ref[at:at + 3]})"
    if margin is not None and at < len(ours) and at < len(ref):
        detail += f"; reference top-2 margin there {margin:.2e}"
    return detail


if __name__ == "__main__":
    common.run(main)
