"""MoE routing and experts vs transformers' Qwen3MoeSparseMoeBlock on random input (fp32).

Router: softmax over the experts' logits, top-k, optional renormalisation (norm_topk_prob).
Checked: the chosen experts (as sets per token: the order of equal-rank picks is not part of the
contract), their weights, and the block output (sum over the chosen experts of weight x
down(silu(gate(x)) * up(x))), with expert weights in f32 and in bf16 storage.

Shapes (n tokens, h hidden, E experts, k per token, I moe_intermediate_size):
  x [n, h]; router [E, h]; router_logits [n, E]; weights, experts [n, k];
  experts_gate_up [E, 2*I, h] (gate rows then up rows, as transformers fuses them); experts_down [E, h, I].
"""

from __future__ import annotations

try:
    from alignment import common
except ImportError:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from alignment import common

import math

import numpy as np

TOL = 1e-5  # routing weights and block output, f32 experts
TOL_BF16 = 1e-5  # bf16-stored experts: the same bf16 values upcast on both sides

# (name, hidden, experts, top_k, moe_intermediate_size, norm_topk_prob, tokens)
CASES = [
    ("8 experts top-2 renormalised", 96, 8, 2, 64, True, 37),
    ("8 experts top-2 raw softmax", 96, 8, 2, 64, False, 37),
    ("one token", 96, 8, 2, 64, True, 1),
    ("128 experts top-8 (Qwen3-30B-A3B routing)", 128, 128, 8, 32, True, 64),
]


def make_block(hidden, experts, top_k, inter, normalize, seed):
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=normalize, experts_implementation="eager",
    )
    block = Qwen3MoeSparseMoeBlock(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(experts, hidden, generator=g) * (2.0 / math.sqrt(hidden)))
        block.experts.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden))
        block.experts.down_proj.copy_(torch.randn(experts, hidden, inter, generator=g) / math.sqrt(inter))
    return block


def sort_by_expert(experts: np.ndarray, weights: np.ndarray):
    order = np.argsort(experts, axis=1, kind="stable")
    return np.take_along_axis(experts, order, 1), np.take_along_axis(weights, order, 1)


def run_experts(x, experts, weights, gate_up, down, fmt):
    moe_experts, moe_scratch = common.kernel("moe_experts"), common.kernel("moe_scratch")
    n, h = x.shape
    E, two_i, _ = gate_up.shape
    out = np.zeros((n, h), np.float32)
    scratch = moe_scratch(n, experts.shape[1], E, h, two_i // 2)
    moe_experts(x, experts, weights, gate_up, down, fmt, out, scratch)
    return out


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0], variants=False)
    p.parse_args(argv)
    common.torch_setup()
    import torch

    from ellmd.kernels import formats

    route, matmul = common.kernel("route"), common.kernel("matmul")
    prefill_scratch_size = common.kernel("prefill_scratch_size")
    report = common.Report("MoE routing and experts vs transformers Qwen3MoeSparseMoeBlock")
    rng = np.random.default_rng(0)
    for index, (name, h, E, k, inter, normalize, n) in enumerate(CASES):
        block = make_block(h, E, k, inter, normalize, seed=index)
        x = rng.standard_normal((n, h)).astype(np.float32)
        with torch.no_grad():
            xt = torch.from_numpy(x)
            ref_logits, ref_weights, ref_experts = block.gate(xt)
            ref_out = block(xt[None])[0].numpy()
        ref_experts, ref_weights = sort_by_expert(ref_experts.numpy(), ref_weights.numpy())

        router = block.gate.weight.numpy()  # [E, h]
        router_logits = np.zeros((n, E), np.float32)  # [n, E], as the engine computes them
        scratch = np.zeros(prefill_scratch_size(E, h), np.float32)
        matmul(x, np.ascontiguousarray(router), formats.F32, router_logits, scratch)
        report.compare(f"{name}: router logits", router_logits, ref_logits.numpy(), TOL)
        weights = np.zeros((n, k), np.float32)
        experts = np.zeros((n, k), np.int64)
        route(router_logits, k, normalize, weights, experts)
        experts_sorted, weights_sorted = sort_by_expert(experts, weights)
        same = experts_sorted == ref_experts
        mismatched = int((~same.all(axis=1)).sum())
        report.check(f"{name}: chosen experts", mismatched == 0, f"{mismatched} of {n} tokens differ")
        if mismatched == 0:
            report.compare(f"{name}: routing weights", weights_sorted, ref_weights, TOL)
        # Each token's weights sum to 1 when renormalised.
        if normalize:
            report.compare(f"{name}: weights sum to 1", weights.sum(axis=1), np.ones(n), TOL)

        gate_up = np.ascontiguousarray(block.experts.gate_up_proj.detach().numpy())
        down = np.ascontiguousarray(block.experts.down_proj.detach().numpy())
        out = run_experts(x, experts, weights, gate_up, down, formats.F32)
        report.compare(f"{name}: block output (f32 experts)", out, ref_out, TOL)

        # bf16 storage: round the experts to bf16 on both sides.
        with torch.no_grad():
            block.experts.gate_up_proj.copy_(block.experts.gate_up_proj.to(torch.bfloat16).float())
            block.experts.down_proj.copy_(block.experts.down_proj.to(torch.bfloat16).float())
            ref_out_bf16 = block(xt[None])[0].numpy()
        out = run_experts(
            x, experts, weights, formats.to_storage(gate_up, formats.BF16), formats.to_storage(down, formats.BF16), formats.BF16
        )
        report.compare(f"{name}: block output (bf16 experts)", out, ref_out_bf16, TOL_BF16)
    return report.exit_code()


if __name__ == "__main__":
    common.run(main)
