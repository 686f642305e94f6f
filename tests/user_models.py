"""Small user-defined models for tests of `--model package.module:callable`."""

from __future__ import annotations

import torch
from torch import nn

from workbench.capture.models import Workload


class TinyMLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def mlp(layers: int = 2, batch: int = 8):
    """(model, (inputs, target)): the default loss is cross entropy on integer labels."""
    torch.manual_seed(0)
    return TinyMLP(depth=layers), (torch.randn(batch, 16), torch.randint(0, 4, (batch,)))


def mlp_with_loss():
    torch.manual_seed(0)
    model = TinyMLP()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).sum()

    return model, (torch.randn(8, 16), torch.randn(8, 4)), loss_fn


def mlp_workload() -> Workload:
    torch.manual_seed(0)
    return Workload(TinyMLP(), torch.randn(8, 16), torch.randint(0, 4, (8,)), name="mlp")


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python branch on a tensor value: not traceable
            return self.lin(x)
        return -self.lin(x)


def data_dependent():
    return DataDependent(), (torch.randn(8, 16), torch.randint(0, 4, (8,)))


def not_a_model():
    return "model", torch.randn(2)


def vector_loss():
    model = TinyMLP()
    return model, (torch.randn(8, 16), torch.randn(8, 4)), lambda out, tgt: out - tgt


class WrittenBlock(nn.Module):
    """Reads a matmul's output `a`, then writes it in place: `b` must see `a` before the
    write, the cosine after it. A recompute of `b` in backward from the written storage, or
    one that replays the write first, differs. `sin_first` swaps the sum's terms, which
    swaps the order backward reads `b` and the written `a`."""

    def __init__(self, width: int, sin_first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.sin_first = sin_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        b = a * 3.0  # reads `a` before the write (mul's backward keeps nothing of it)
        a.mul_(0.5)  # the write: its backward keeps nothing either, so autograd allows it
        return b.sin() + a.cos() if self.sin_first else a.cos() + b.sin()


class WrittenBlocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(WrittenBlock(width, i % 2 == 0) for i in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def written_blocks(layers: int = 2, batch: int = 8):
    """A model whose layers read a storage before an in-place write (`WrittenBlock`)."""
    torch.manual_seed(0)
    return WrittenBlocks(depth=layers), (torch.randn(batch, 16), torch.randint(0, 4, (batch,)))


def mlp_with_dtype(dtype: torch.dtype = torch.float32):
    """A factory taking `dtype`: --dtype reaches it (recorded for the test)."""
    torch.manual_seed(0)
    model = TinyMLP().to(dtype)
    inputs = (torch.randn(8, 16, dtype=dtype), torch.randint(0, 4, (8,)))
    return Workload(model, *inputs, name="mlp", config={"dtype_given": str(dtype)})


def mlp_float32():
    """A factory that builds float32 whatever the default dtype: --dtype cannot apply."""
    torch.manual_seed(0)
    return TinyMLP().float(), (torch.randn(8, 16), torch.randint(0, 4, (8,)))


def _hf_llama(seq: int = 64):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class HfOwnLoss(nn.Module):
    """transformers' own loss through `labels=`: the model returns the loss itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _hf_llama()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids, labels=ids).loss


def hf_llama_own_loss():
    """(model, (ids, None), loss_fn): the target is None, the loss the model's own."""
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    return HfOwnLoss(), (ids, None), lambda loss, _: loss


class HfMasked(nn.Module):
    """The old workaround: an all-ones attention mask, which transformers turns into a dense
    mask under tracing (SDPA with attn_mask) and drops eagerly (SDPA with is_causal)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _hf_llama()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids, attention_mask=torch.ones_like(ids)).logits


def hf_llama_masked():
    ids = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(0))
    return HfMasked(), (ids[:, :-1], ids[:, 1:])
