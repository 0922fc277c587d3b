"""Test session setup."""

import jax

# Pallas interpret mode runs jax operations inside the kernels' host callbacks; with the CPU
# client's asynchronous dispatch that can deadlock on a small machine. Tests dispatch
# synchronously.
jax.config.update("jax_cpu_enable_async_dispatch", False)
