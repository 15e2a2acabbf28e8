"""A synthetic Llama target and EAGLE-3 draft whose acceptance is known by construction.

DESIGN.md's recipe. Every attention and MLP output projection is zero, so the residual stream
is the token's embedding at every layer, and so is every auxiliary hidden state the draft
reads. The target's lm_head is (c / hidden) * E, so the logit of the current token is about c
and every other logit is about 0: the target repeats its last token with probability

    p = e^(c/T) / (e^(c/T) + vocab - 1)        at sampling temperature T,

and greedily always does. The draft's fc picks the first auxiliary state and its lm_head is E,
so it proposes the token whose embedding that state is: the input at the last verified
position, not the bonus token sampled there. With SGLang's target-only verify (a draft token d
is accepted with the target's probability of d; after a rejection the bonus token is sampled
with d excluded) a verify round is a two-state chain:
  R (the bonus token repeated): each draft is accepted with p, so the round yields
    1 + p + ... + p^k tokens; the next round is R again only if all k drafts and the new
    bonus repeat (p^(k+1)); a rejection excludes the repeat, so its bonus does not repeat;
  N (it did not): the first draft is wrong, the round yields 1 token, and its bonus repeats
    with p.
The stationary share of R is p / (p + 1 - p^(k+1)), and the accept length follows (4.0 greedy
at 3 steps; on the GPU, T = 1.0 and 0.9 at c = 12 predict 2.31 and 3.28 against 2.22-2.36 and
3.15-3.37 measured, lab/gpu/results/recovery-*.log). The request temperature sets
it, with no new weights. The compute cost is that of a real model of the same shape: zero
weights are multiplied like any others.

The draft's KV cache does not affect its predictions (its attention output is zero). So this
pair cannot show whether the draft KV cache stayed in sync after speculation was off. With
--context-gain g the draft reads it (draftkv.py, check 3's draft-KV half): its query and key
projections stay zero, so it attends uniformly over its whole KV cache; its value projection
copies the first kv_heads x head_dim dimensions of its normed input embedding, and its output
projection writes one query head per KV group back to those hidden dimensions, times g. Its
logits become E . norm(e(t) + g * m), m the mean over the request's draft KV cache of those
embedding dimensions: where one token fills most of the context, the draft proposes it instead
of the current token (`context_flip` says where that stops).

Needs torch and safetensors (SGLang's own dependencies) and a GPU to write quickly:
    python3 synthetic.py OUT_DIR [--hidden 3072 --layers 28 ...]
Run on the GPU machine on 2026-11-30 (recovery.py, lab/bench/gpu_envelope.py): the 3B pair is
written in about 17 s.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

VOCAB = 32000


def configs(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    target = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    draft = {
        **target,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": VOCAB,
        "target_hidden_size": hidden,
    }
    return target, draft


def acceptance(c: float, temperature: float, steps: int) -> tuple[float, float]:
    """(p, accept length) predicted for the pair at a sampling temperature (0: greedy)."""
    if temperature == 0:
        p = 1.0
    else:
        z = c / temperature
        p = 1.0 / (1.0 + (VOCAB - 1) * math.exp(-z))
    if p == 1.0:
        return p, float(1 + steps)
    repeated = p / (p + 1 - p ** (steps + 1))  # stationary share of rounds in state R
    return p, repeated * sum(p**j for j in range(steps + 1)) + (1 - repeated)


def context_flip(prefix: int, gain: float, hidden: int, kv_dim: int) -> float:
    """With --context-gain: for a prompt of `prefix` copies of token A and then one B (the
    target then repeats B), how many B tokens the draft's KV cache must hold beyond the prompt
    before the draft proposes B rather than A. B's logit is about hidden + g kv_dim f_B and
    A's g kv_dim f_A (f the tokens' shares of the draft's context; a random embedding's product
    with another is about 0), so B wins once g kv_dim (f_A - f_B) < hidden."""
    weight = gain * kv_dim
    return max(0.0, (weight * (prefix - 1) - hidden * (prefix + 1)) / (weight + hidden))


def write_pair(
    out: Path,
    target: dict[str, Any],
    draft: dict[str, Any],
    c: float,
    device: str = "cuda",
    seed: int = 0,
    context_gain: float = 0.0,
) -> None:
    import torch
    from safetensors.torch import save_file

    h, n = target["hidden_size"], target["num_hidden_layers"]
    d = target["head_dim"]
    q_out, kv_out = target["num_attention_heads"] * d, target["num_key_value_heads"] * d
    inter = target["intermediate_size"]
    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    embed = torch.randn((VOCAB, h), generator=gen, device=device, dtype=torch.float32)

    def zeros(*shape: int) -> Any:
        return torch.zeros(shape, dtype=bf16, device=device)

    def ones(size: int) -> Any:
        return torch.ones((size,), dtype=bf16, device=device)

    def layer(prefix: str, in_dim: int) -> dict[str, Any]:
        return {
            f"{prefix}.self_attn.q_proj.weight": zeros(q_out, in_dim),
            f"{prefix}.self_attn.k_proj.weight": zeros(kv_out, in_dim),
            f"{prefix}.self_attn.v_proj.weight": zeros(kv_out, in_dim),
            f"{prefix}.self_attn.o_proj.weight": zeros(h, q_out),
            f"{prefix}.mlp.gate_proj.weight": zeros(inter, h),
            f"{prefix}.mlp.up_proj.weight": zeros(inter, h),
            f"{prefix}.mlp.down_proj.weight": zeros(h, inter),
            f"{prefix}.input_layernorm.weight": ones(h),
            f"{prefix}.post_attention_layernorm.weight": ones(h),
        }

    weights: dict[str, Any] = {
        "model.embed_tokens.weight": embed.to(bf16),
        "model.norm.weight": ones(h),
        "lm_head.weight": (embed * (c / h)).to(bf16),
    }
    for i in range(n):
        weights.update(layer(f"model.layers.{i}", h))
    (out / "target").mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "target" / "model.safetensors")
    )
    (out / "target" / "config.json").write_text(json.dumps(target, indent=1))
    del weights

    # The draft: fc takes the first of the three auxiliary states; its embedding comes from
    # the target (SGLang shares it for EAGLE-3); lm_head = E proposes the current token.
    fc = zeros(h, 3 * h)
    fc[:, :h] = torch.eye(h, dtype=bf16, device=device)
    draft_weights = {
        "fc.weight": fc,
        "norm.weight": ones(h),
        "lm_head.weight": embed.to(bf16),
        "layers.0.hidden_norm.weight": ones(h),
        **layer("layers.0", 2 * h),
    }
    if context_gain:
        # The layer's input is [norm(embeds), norm(hidden)]: values copy the embedding's first
        # kv_out dimensions; the first query head of each KV group writes its head back.
        v = draft_weights["layers.0.self_attn.v_proj.weight"]
        v[:, :kv_out] = torch.eye(kv_out, dtype=bf16, device=device)
        o = draft_weights["layers.0.self_attn.o_proj.weight"]
        group = target["num_attention_heads"] // target["num_key_value_heads"]
        for k in range(target["num_key_value_heads"]):
            o[k * d : (k + 1) * d, k * group * d : (k * group + 1) * d] = context_gain * torch.eye(
                d, dtype=bf16, device=device
            )
    (out / "draft").mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in draft_weights.items()},
        str(out / "draft" / "model.safetensors"),
    )
    (out / "draft" / "config.json").write_text(json.dumps(draft, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--c", type=float, default=12.0, help="the current token's logit")
    parser.add_argument(
        "--context-gain", type=float, default=0.0, help="> 0: the draft reads its KV cache"
    )
    args = parser.parse_args()
    target, draft = configs(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    write_pair(Path(args.out), target, draft, args.c, context_gain=args.context_gain)
    for t in (0.0, 0.8, 0.9, 1.0):
        p, length = acceptance(args.c, t, steps=3)
        print(f"temperature {t}: p = {p:.3f}, predicted accept length at 3 steps {length:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
