"""Alignment checks: ellm's numbers against Hugging Face transformers (torch fp32), same weights.

One script per check, each runnable as `python alignment/<name>.py [--dir CACHE] [--variant V]`,
printing max abs / max relative error per comparison and exiting non-zero past tolerance; each
exposes `main(argv=None) -> int`, which tests/test_alignment.py runs.

  rmsnorm, rope, silu_mul, moe_routing      kernels vs transformers modules
  one_token, multi_token, multi_batch,      the engine on tiny random checkpoints of every family
  incremental_prefill, kv_roundtrip           (checkpoints.py writes them)
  smollm2_greedy                            the real SmolLM2 GGUF: logits and identical greedy ids
  kv_dtype_report                           bf16 / f16 KV error figures (loose tolerance)
  rounded_activations                       bf16 products of activations rounded once (the default),
                                              within transformers bf16's error; the model checks above
                                              run two halves (common.TOL)
  tokenizer_chat_template                   ellmd.text vs AutoTokenizer

common.py holds the error report, the reference-model loaders and the engine factory.
"""
