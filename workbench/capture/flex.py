"""FlexAttention as a GPU runs it, traced on fake CPU tensors.

torch's `flex_attention` refuses a CPU backward at its Python entry, and torchtitan calls it
through `torch.compile`; what the GPU runs is the `flex_attention` higher-order op, whose
autograd saves q, k, v, the output and the fp32 log-sum-exp and whose backward is the
`flex_attention_backward` op. Both have fake kernels, so the op traces on fake CPU tensors
with the block mask built small on the CPU (one entry per 128 x 128 block).

Entry points: `causal_block_mask(batch, seq, block_size)`, `flex_attention_op(...)` (the
op itself, called as torchtitan calls its compiled flex attention) and `block_mask_names`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.nn.attention.flex_attention import (
    AuxOutput,
    AuxRequest,
    BlockMask,
    _apply_kernel_options,
    create_block_mask,
)

__all__ = [
    "BLOCK_MASK_FIELDS",
    "block_mask_names",
    "block_mask_sparsity",
    "causal_block_mask",
    "flex_attention_op",
]

# A BlockMask's tensors, in the order its `as_tuple()` hands them to the op.
BLOCK_MASK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _causal(batch: Any, head: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


def causal_block_mask(batch: int, seq: int, block_size: int | tuple[int, int] = 128) -> BlockMask:
    """The block-causal mask of `batch` sequences of one document each (what torchtitan's
    causal and packed-document masks give when no sequence packs two documents), built on
    the CPU from its block tables: query block i reads key blocks 0..i-1 whole and block i
    in part. `create_block_mask` would evaluate the mask at every (query, key) pair first,
    seq x seq booleans, which long contexts cannot hold; this is its result (a test checks)."""
    size = block_size if isinstance(block_size, int) else block_size[0]
    if not isinstance(block_size, int) and block_size[0] != block_size[1]:
        return create_block_mask(
            _causal, B=batch, H=None, Q_LEN=seq, KV_LEN=seq, device="cpu", BLOCK_SIZE=block_size
        )
    n = -(-seq // size)
    rows = torch.arange(n, dtype=torch.int32)
    ragged = seq % size != 0  # the last query block is cut short: none of its blocks is whole
    # key blocks each query block reads: its diagonal in part, the ones before it whole
    kv_counts, full_kv_counts = torch.ones(n, dtype=torch.int32), rows.clone()
    kv_partial = rows.view(n, 1).expand(n, n).contiguous()
    kv_full = rows.expand(n, n).contiguous()
    # query blocks reading each key block: its diagonal in part, the ones after it whole
    q_counts, full_q_counts = torch.ones(n, dtype=torch.int32), n - 1 - rows
    q_partial = kv_partial.clone()
    q_full = (rows.view(n, 1) + 1 + rows.view(1, n)) % n
    if ragged:
        kv_counts[-1], full_kv_counts[-1], kv_partial[-1] = n, 0, rows
        full_q_counts[-1] = 0
        if n > 1:  # the last query block also reads every key block before it in part
            q_counts[:-1], full_q_counts[:-1] = 2, n - 2 - rows[:-1]
            q_partial[:-1, 1] = n - 1

    def per_batch(table: torch.Tensor) -> torch.Tensor:
        return table.expand(batch, 1, *table.shape).contiguous()

    return BlockMask(
        (seq, seq),
        kv_num_blocks=per_batch(kv_counts),
        kv_indices=per_batch(kv_partial),
        full_kv_num_blocks=per_batch(full_kv_counts),
        full_kv_indices=per_batch(kv_full),
        q_num_blocks=per_batch(q_counts),
        q_indices=per_batch(q_partial),
        full_q_num_blocks=per_batch(full_q_counts),
        full_q_indices=per_batch(q_full),
        BLOCK_SIZE=(size, size),
        mask_mod=_causal,
    )


def block_mask_sparsity(mask: BlockMask) -> float:
    """The share of (query block, key block) tiles the kernel skips: torch's flop counter
    takes it as flex attention's `sparsity_hint` (it counts every pair otherwise)."""
    visited = mask.kv_num_blocks.sum() + (
        mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0
    )
    batch, heads, rows, columns = mask.kv_indices.shape
    return 1.0 - float(visited) / (batch * heads * rows * columns)


def block_mask_names(mask: BlockMask, prefix: str = "attention_masks") -> dict[int, str]:
    """`id(tensor) -> "PREFIX.FIELD"` for the mask's tensors, to name them as graph inputs."""
    return {
        id(tensor): f"{prefix}.{name}"
        for name in BLOCK_MASK_FIELDS
        if isinstance(tensor := getattr(mask, name), torch.Tensor)
    }


def _identity_score(score: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
    return score


def flex_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    score_mod: Any = None,
    block_mask: BlockMask,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_aux: AuxRequest | None = None,
    kernel_options: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, AuxOutput]:
    """The `flex_attention` op with torchtitan's compiled call's signature and result
    (`(out, AuxOutput)`): what the GPU kernel computes and saves, without the CPU refusal
    or `torch.compile`. The log-sum-exp is returned in natural log, as the entry returns it."""
    options: Any = _apply_kernel_options(query, key, value, False, kernel_options, return_aux)  # type: ignore[arg-type]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out, lse, _ = flex_attention_hop(
        query,
        key,
        value,
        score_mod or _identity_score,
        block_mask.as_tuple(),
        scale,
        options,
    )
    wants_lse = return_aux is not None and return_aux.lse
    return out, AuxOutput(lse=lse * math.log(2.0) if wants_lse else None, max_scores=None)
