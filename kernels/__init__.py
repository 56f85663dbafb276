"""Triton kernels of mhakern (installed as mhakern.kernels)."""
