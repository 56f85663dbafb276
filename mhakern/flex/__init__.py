"""mhakern.flex: torch's FlexAttention interface (``score_mod``, ``mask_mod``, ``BlockMask``) on
mhakern's kernels. ``mhakern.flex_attention`` is :func:`flex_attention`; the modifiers are
traced once and compiled into the cpu kernel (graph.py, build.py, csrc/flex/flex_kernel.cpp);
:func:`reference` is the plain-PyTorch oracle. Imported on first use of ``mhakern.flex`` or
``mhakern.flex_attention`` (importing it loads torch.fx)."""
from .api import KERNEL_OPTIONS, flex_attention, precompile, reference

__all__ = ["flex_attention", "precompile", "reference", "KERNEL_OPTIONS"]
