"""kvlowrank GPU kernels, installed as the package `kvlowrank_kernels`.

Each op lives in its own sub-package with a plain-jnp reference beside the GPU
backends and an `implementation=` dispatcher that falls back to the reference.
"""
