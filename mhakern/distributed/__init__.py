"""Context parallelism on torch.distributed: attention over a sequence sharded across the
ranks of a group (ring, all-gather and Ulysses), exact, forward and backward, plus the helpers
that lay tensors out over the group and gather them back. docs/usage.md, "Context
parallelism", says which method when and shows a two-process example.
"""
from ._comm import ContextParallelError
from .context_parallel import METHODS, context_parallel_attention, context_parallel_attention_varlen
from .layout import LAYOUTS, shard, shard_varlen, unshard, unshard_varlen

__all__ = [
    "context_parallel_attention", "context_parallel_attention_varlen", "shard", "unshard", "shard_varlen",
    "unshard_varlen", "ContextParallelError", "METHODS", "LAYOUTS",
]
