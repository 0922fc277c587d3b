"""cuDNN's packed flash attention as a segment_attention family, fed seqpack's offsets and lengths.

JAX reaches cuDNN's packed (THD) layout only through a private module:
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` with `q_seqlen` / `kv_seqlen`
i32[B, M] and `q_offsets` / `kv_offsets` i32[B, M + 1] (-1 for unused slots, anywhere in a row),
`mask_type` PADDING_CAUSAL (causal from each segment's start) or PADDING, layout BTNH. cuDNN
visits only the tiles of each segment, forward and backward, and differentiates itself (a VJP of
its own), so this family's `attend` is the whole op (`own_vjp`).

The guard, so that `auto` never runs a wrong cuDNN path:
- installation (`requires`): the module and its packed arguments importable, a CUDA backend, a
  GPU of compute capability >= 9.0 (the packed layout is Hopper's and later);
- per call (`refuses`): bfloat16 / float16, a head dim that is a multiple of 8 up to 128, no
  ring step of context parallelism (it runs no schedule), and grouped-query attention only where
  JAX scales the key offsets by the key's own heads. Up to jax 0.11.0 it scaled them by the
  query's (jax PR #39521): keys of the wrong tokens, silently. `kv_offsets_follow_key_heads`
  asks the module's own offset fix-up (pure jnp) instead of trusting a version number.
Rows outside every segment: inputs zeroed before the call and outputs zeroed after it (cuDNN
leaves them unwritten), so NaN in padding reaches nothing and its gradients are 0.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp

from seqpack.kernels.attention_schedule import (
    AttentionCall,
    AttentionConfig,
    LseLayout,
    token_bounds,
)
from seqpack.kernels.common import Impl, Target

PACKED_ARGUMENTS = {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type"}
DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 128


@functools.cache
def library():
    """(cuDNN's dot_product_attention, its MaskType), or None where this JAX lacks them."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as module
    except ImportError:
        return None
    fn, masks = getattr(module, "dot_product_attention", None), getattr(module, "MaskType", None)
    if fn is None or masks is None or not PACKED_ARGUMENTS <= set(inspect.signature(fn).parameters):
        return None
    return fn, masks


@functools.cache
def kv_offsets_follow_key_heads() -> bool:
    """Whether this JAX turns packed key offsets into element offsets with the key's heads: its
    fix-up run on one GQA row (2 query heads, 1 key head, D = 8, segments at 0 and 2); False
    where the fix-up cannot be found or run (GQA is then refused, never guessed)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import _fix_seqlen_offsets
        with jax.ensure_compile_time_eval():
            seqlen = jnp.array([[2, 2]], jnp.int32)
            starts = jnp.array([[0, 2, -1]], jnp.int32)
            *_, kv = _fix_seqlen_offsets(seqlen, seqlen, starts, starts,
                                         jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 8)))
            return int(kv[0, 1]) == 2 * 1 * 8
    except Exception:  # noqa: BLE001 (a private function: any change of it means "unknown")
        return False


def requires() -> str | None:
    """Why cuDNN's packed attention cannot run in this installation, or None."""
    if library() is None:
        return (f"jax {jax.__version__} has no cuDNN packed attention (jax._src.cudnn."
                "fused_attention_stablehlo.dot_product_attention with q_offsets)")
    backend = jax.default_backend()
    device = jax.devices()[0]
    version = str(getattr(getattr(device, "client", None), "platform_version", ""))
    if backend != "gpu" or "cuda" not in version.lower():
        return f"it needs a CUDA GPU (the backend here is {backend!r})"
    capability = str(getattr(device, "compute_capability", "0.0"))
    if int(capability.split(".")[0]) < 9:
        return (f"cuDNN's packed layout needs compute capability >= 9.0 (Hopper); this GPU has "
                f"{capability}")
    return None


CUDNN = Target(Impl.CUDNN, "gpu", pallas=False, requires=lambda: requires())


def packed_metadata(offsets: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """seqpack's [B, S] offsets and lengths -> cuDNN's seqlen i32[B, S] and offsets
    i32[B, S + 1]: -1 for every slot of length 0 (cuDNN shifts the live ones together)."""
    used = lengths > 0
    seqlen = jnp.where(used, lengths, -1).astype(jnp.int32)
    starts = jnp.where(used, offsets, -1).astype(jnp.int32)
    return seqlen, jnp.pad(starts, ((0, 0), (0, 1)), constant_values=-1)


@dataclasses.dataclass(frozen=True)
class NoBlockSizes:
    """cuDNN picks its own tiles: nothing to set."""


@dataclasses.dataclass(frozen=True)
class CudnnAttention:
    """Segment attention by cuDNN's packed flash attention (a library family, no interpreter)."""

    target = CUDNN
    block_sizes = NoBlockSizes
    needs_schedule = False
    own_vjp = True
    lse_layout = LseLayout.BHL  # not exposed: cuDNN keeps its statistics to itself
    operands = ("blhd",)  # BTNH; jax's offset fix-up assumes that stride

    def refuses(self, call: AttentionCall) -> str | None:
        if call.ring:
            return ("cuDNN runs no block schedule, which each ring step of context parallelism "
                    "needs; pass a Pallas family")
        if jnp.dtype(call.dtype).name not in DTYPES:
            return f"cuDNN's flash attention takes {' or '.join(DTYPES)}, not {call.dtype}"
        if call.head_dim % 8 or call.head_dim > MAX_HEAD_DIM:
            return f"head dim {call.head_dim}: cuDNN takes multiples of 8 up to {MAX_HEAD_DIM}"
        if call.kv_heads != call.heads and not kv_offsets_follow_key_heads():
            return (f"jax {jax.__version__} reads keys of the wrong tokens under grouped-query "
                    "attention in cuDNN's packed layout (jax PR #39521, fixed in 0.11.1)")
        return None

    def configure(self, cfg: AttentionConfig, blocks: NoBlockSizes, batch: int) -> AttentionConfig:
        del blocks, batch
        return cfg

    def attend(self, q, k, v, offsets, lengths, cfg: AttentionConfig) -> jax.Array:
        """o [B, L, H, D]: cuDNN over the live rows, 0 outside segments."""
        fn, masks = library()
        _, end = token_bounds(offsets, lengths, cfg.seq_len, cfg.seq_len)
        live = (end > 0)[:, :, None, None]
        zero = lambda x: jnp.where(live, x, jnp.zeros((), x.dtype))  # noqa: E731
        seqlen, starts = packed_metadata(offsets, lengths)
        o = fn(zero(q), zero(k), zero(v), q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=starts,
               kv_offsets=starts, scale=cfg.scale, qkv_layout="BTNH",
               mask_type=masks.PADDING_CAUSAL if cfg.causal else masks.PADDING)
        return zero(o)

    def forward(self, q, k, v, sched, cfg: AttentionConfig):
        raise NotImplementedError("cuDNN differentiates itself (own_vjp): call attend")

    def backward(self, q, k, v, o, lse, do, sched, cfg: AttentionConfig):
        raise NotImplementedError("cuDNN differentiates itself (own_vjp): call attend")


ATTENTION = CudnnAttention()
