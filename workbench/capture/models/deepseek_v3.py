"""DeepSeek-V3-style mixture-of-experts decoder, small enough for a CPU.

Entry points: `DSV3_FLAVORS` (name -> `DeepSeekV3Config`) and `DeepSeekV3(config, seq_len)`.
Routing follows DeepSeek-V3 (sigmoid scores, top-k, renormalised, routed experts through
`torch._grouped_mm` plus a shared expert, dense first layers); attention is the Llama3
grouped-query attention, not multi-head latent attention, which SAC decisions do not need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.capture.models.llama3 import FeedForward, Llama3, Llama3Config


@dataclass(frozen=True)
class DeepSeekV3Config:
    dim: int
    n_layers: int
    n_dense_layers: int
    n_heads: int
    vocab_size: int
    dense_ffn_hidden: int
    n_experts: int
    top_k: int
    expert_hidden: int
    n_shared_experts: int
    route_scale: float = 1.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def block_config(self) -> Llama3Config:
        return Llama3Config(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            vocab_size=self.vocab_size,
            ffn_hidden=self.dense_ffn_hidden,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
        )


DSV3_FLAVORS: dict[str, DeepSeekV3Config] = {
    "debugmodel": DeepSeekV3Config(
        dim=256,
        n_layers=3,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=2048,
        dense_ffn_hidden=1024,
        n_experts=8,
        top_k=3,
        expert_hidden=256,
        n_shared_experts=2,
    ),
    # torchtitan's deepseek_v3 "16B" (DeepSeek-MoE 16B) shape: dim, layers (the first
    # dense), heads, vocabulary, dense FFN, 64 routed experts of hidden 1408, top 6, 2 shared.
    # Attention is Llama3-style GQA with 16 heads of 128 (no kv sharing), not its multi-head
    # latent attention (kv_lora_rank 512, rope dim 64), and the router scores by sigmoid, not
    # its softmax: the experts' and the FFN's parameters are its, attention's are not.
    # Built on meta (fake-mode traces, the planner); ~16B parameters do not fit a CPU run.
    "16B": DeepSeekV3Config(
        dim=2048,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=102400,
        dense_ffn_hidden=10944,
        n_experts=64,
        top_k=6,
        expert_hidden=1408,
        n_shared_experts=2,
    ),
}


class Router(nn.Module):
    """Sigmoid top-k router; `gate` is the router matmul whose SAC decision matters."""

    def __init__(self, dim: int, n_experts: int, top_k: int, route_scale: float) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.top_k = top_k
        self.route_scale = route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x).float())
        top_scores, top_experts = scores.topk(self.top_k, dim=-1)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True) * self.route_scale
        return top_scores.type_as(x), top_experts


class GroupedExperts(nn.Module):
    """All routed experts' SwiGLU weights stacked, applied to expert-sorted tokens at once."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # torch._grouped_mm is bf16-only (its meta kernel checks), so experts compute in
        # bf16 whatever the model dtype, as in mixed-precision training.
        xb = x.to(torch.bfloat16)
        w1, w2, w3 = (w.to(torch.bfloat16) for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch._grouped_mm(xb, w1, offs=offsets))
        h = h * torch._grouped_mm(xb, w3, offs=offsets)
        return torch._grouped_mm(h, w2, offs=offsets).to(x.dtype)


class MoE(nn.Module):
    """Routed experts plus always-on shared experts; shapes stay static for tracing."""

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.router = Router(config.dim, config.n_experts, config.top_k, config.route_scale)
        self.experts = GroupedExperts(config.dim, config.expert_hidden, config.n_experts)
        self.shared_experts = FeedForward(
            config.dim, config.expert_hidden * config.n_shared_experts
        )
        # (experts, routed token copies, tokens per expert) -> outputs over expert
        # parallelism (`workbench.capture.expert_parallel.ExpertDispatch`); None: all local
        self.dispatch: Callable[[GroupedExperts, torch.Tensor, torch.Tensor], torch.Tensor] | None
        self.dispatch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, experts = self.router(tokens)
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.histc(
            flat_experts.float(), bins=self.n_experts, min=0, max=self.n_experts - 1
        )
        token_of_slot = order // self.top_k
        if self.dispatch is None:
            offsets = counts.cumsum(0).to(torch.int32)
            routed = self.experts(tokens[token_of_slot], offsets)
        else:  # the counts travel to the experts' ranks with the tokens
            routed = self.dispatch(self.experts, tokens[token_of_slot], counts)
        routed = routed * scores.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, token_of_slot, routed)
        return (out + self.shared_experts(tokens)).view(bs, seq, dim)


class DeepSeekV3(Llama3):
    """Token ids (bs, seq) -> logits; blocks after the first `n_dense_layers` use MoE."""

    def __init__(self, config: DeepSeekV3Config, seq_len: int) -> None:
        super().__init__(config.block_config(), seq_len)
        self.moe_config = config
        for layer in list(self.layers.values())[config.n_dense_layers :]:
            layer.feed_forward = MoE(config)
