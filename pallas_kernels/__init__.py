"""Pallas kernels (each file: kernel + wrapper + input checks + a plain-jnp reference)."""
