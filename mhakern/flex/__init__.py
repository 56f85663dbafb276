"""mhakern.flex: torch's FlexAttention interface (``score_mod``, ``mask_mod``, ``BlockMask``) on
mhakern's kernels. ``mhakern.flex_attention`` is :func:`flex_attention`; the modifiers are
traced once and compiled into the cpu kernel (graph.py, build.py, csrc/flex/flex_kernel.cpp);
:func:`reference` is the plain-PyTorch oracle. Imported on first use of ``mhakern.flex`` or
``mhakern.flex_attention`` (importing it loads torch.fx and dynamo)."""
import torch

from . import api
from .api import KERNEL_OPTIONS, precompile, reference
from .masks import causal_block_mask, document_block_mask, prefix_lm_block_mask

# Under torch.compile a call is a graph break (the modifiers are Python callables, not operator
# arguments): dynamo runs it eagerly, between the compiled graphs around it, and with
# fullgraph=True says why in one line. Outside torch.compile this wrapper costs nothing.
flex_attention = torch.compiler.disable(
    api.flex_attention,
    reason="mhakern.flex_attention runs eagerly: score_mod and mask_mod are Python callables it traces "
    "and compiles itself, not operator arguments",
)

__all__ = [
    "flex_attention", "precompile", "reference", "KERNEL_OPTIONS", "document_block_mask", "prefix_lm_block_mask",
    "causal_block_mask",
]
