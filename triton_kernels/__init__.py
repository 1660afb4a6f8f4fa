"""Triton kernels of spectral-ops. Installed as ``spectral_ops.triton_kernels``, never as a top-level
``triton_kernels`` (other distributions own that name): import it through the package, or relatively.
"""
