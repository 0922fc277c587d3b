"""Compile seqpack's Triton kernels for Hopper (sm_90) on any machine, no GPU: what each tile
configuration costs in registers, spills and shared memory, and whether its dots are wgmma.

    pip install triton                    # standalone Triton (3.6 on the lent GPU machine)
    python -m benchmarks.triton_sm90                          # attention at D=64 and 128, the ops
    python -m benchmarks.triton_sm90 --head-dims 128 --tiles 64,64 128,64 --warps 8 --stages 2 3

Each op is lowered for CUDA (`lowering_platforms=("cuda",)`), the Triton IR of its pallas_calls
captured, and each kernel compiled by standalone Triton for `cuda:90` in a child process (two
copies of MLIR in one process do not mix), reading registers, stack and local memory off the
cubin (`cuobjdump -res-usage`, bundled with Triton). On the chip XLA compiles the same IR with
its own Triton, so the numbers are a forecast of the chip's, for choosing which tiles it measures.
Columns: wgmma / mma.sync: tensor-core instructions in the PTX (Hopper's async warpgroup MMA, or
Ampere's); cp.async: asynchronous copies into shared memory (0: Triton's software pipeliner
prefetches no load of the loop; it skips loads inside a conditional); regs a thread; spill:
stack frame and local memory a thread, in bytes (0 is the goal: registers spilled to memory);
smem: dynamic shared memory a program; CTAs/SM: programs resident per SM on an H100 (registers,
shared memory and warps; the least of them is named).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

# H100 / H200 (sm_90) per-SM limits: CUDA occupancy calculator's values.
REGS_PER_SM = 65536
SMEM_PER_SM = 233472  # 228 KiB
SMEM_RESERVED_PER_CTA = 1024
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One pallas_call's Triton IR with its launch options, and the case it came from."""

    case: str
    name: str
    ttir: str
    num_warps: int
    num_stages: int


@contextlib.contextmanager
def triton_modules(on_module):
    """While open, every Triton module jax's Pallas lowering emits must pass MLIR's verifier (the
    chip's Triton parses these modules: one that does not verify fails to compile there; a
    ValueError names its kernel), then `on_module(name, op)` sees its kernel name and MLIR
    operation. Hooks jax's private lowering (jax._src.pallas.triton)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    original = registration.lowering.lower_jaxpr_to_triton_module

    def hook(*a, **kw):
        result = original(*a, **kw)
        op = result.module.operation
        found = re.search(r'module @(\w+)|sym_name = "(\w+)"', op.get_asm())
        name = found.group(1) or found.group(2)  # sym_name: the generic form of a bad module
        try:
            op.verify()
        except Exception as e:  # jax's MLIRError: the verifier's diagnostics
            errors = [line for line in str(e).splitlines() if line.startswith("error")]
            raise ValueError(f"the Triton module of {name} does not verify: "
                             f"{errors or e}") from None
        on_module(name, op)
        return result

    registration.lowering.lower_jaxpr_to_triton_module = hook
    try:
        yield
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original


def capture(fn, *args) -> list[tuple[str, str, int, int]]:
    """(name, Triton IR text, num_warps, num_stages) of every pallas_call in `fn` lowered for CUDA
    (`triton_modules`); the launch options are read off the lowered custom calls, matched by
    kernel name."""
    import jax

    caught: list[tuple[str, str]] = []
    with triton_modules(lambda name, op: caught.append(
            (name, op.get_asm(enable_debug_info=False)))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    launches = {m.group(1): (int(m.group(3)), int(m.group(2))) for m in re.finditer(
        r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)}
    missing = {name for name, _ in caught} - set(launches)
    if missing:
        raise ValueError(f"no launch options for kernels {sorted(missing)} in the lowered module")
    return [(name, ttir, *launches[name]) for name, ttir in caught]


def attention_cases(head_dims, tiles, warps, stages) -> list[Kernel]:
    """Forward, dq and dk/dv kernels of segment_attention for each head dim and tile option."""
    import jax
    import jax.numpy as jnp

    from seqpack import kernels

    offsets = jnp.array([[0, 128, 256, 256]], jnp.int32)
    lengths = jnp.array([[128, 128, 0, 0]], jnp.int32)
    out = []
    for d in head_dims:
        q = jax.ShapeDtypeStruct((1, 256, 2, d), jnp.bfloat16)
        for (bq, bk) in tiles:
            for w in warps:
                for s in stages:
                    blocks = kernels.GpuAttentionBlockSizes(bq, bk, bq, bk, num_warps=w,
                                                            num_stages=s)

                    def loss(q, k, v, blocks=blocks):
                        o = kernels.segment_attention(q, k, v, offsets, lengths,
                                                      impl="pallas_gpu", block_sizes=blocks)
                        return o.astype(jnp.float32).sum()

                    grads = jax.grad(loss, argnums=(0, 1, 2))
                    case = f"attention D={d} {bq}x{bk}"
                    out += [Kernel(case, *k) for k in capture(grads, q, q, q)]
    return out


def op_cases() -> list[Kernel]:
    """The other GPU kernels at their default tiles: segment sum and its backward, the gather,
    the cross-entropy, the fused loss head's recompute kernels."""
    import jax
    import jax.numpy as jnp

    from seqpack import kernels

    b, L, d, v = 2, 512, 256, 1024
    offsets = jnp.array([[0, 200, 512, 512]] * b, jnp.int32)
    lengths = jnp.array([[200, 312, 0, 0]] * b, jnp.int32)
    x = jax.ShapeDtypeStruct((b, L, d), jnp.bfloat16)
    logits = jax.ShapeDtypeStruct((b, L, v), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
    targets = jnp.zeros((b, L), jnp.int32)
    g = lambda f, *argnums: jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(),  # noqa: E731
                                     argnums=argnums or (0,))
    cases = {
        "segment_sum": (g(lambda x: kernels.segment_sum(x, offsets, lengths, impl="pallas_gpu")),
                        x),
        "segment_gather": (g(lambda x: kernels.segment_gather(x, offsets, lengths,
                                                              impl="pallas_gpu")), x),
        "cross_entropy": (g(lambda z: kernels.segment_cross_entropy(
            z, targets, offsets, lengths, impl="pallas_gpu")[0]), logits),
        "loss_head": (g(lambda h, w: kernels.segment_linear_cross_entropy(
            h, w, targets, offsets, lengths, mode="recompute", impl="pallas_gpu")[0], 0, 1),
            x, w),
    }
    return [Kernel(case, *k) for case, (fn, *args) in cases.items() for k in capture(fn, *args)]


COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
out = []
for job in json.load(sys.stdin):
    try:
        k = triton.compile(job["path"], target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": job["warps"], "num_stages": job["stages"]})
    except Exception as e:  # a tile the compiler refuses: reported, the rest go on
        out.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
        continue
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    out.append({"wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
                "cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
                "regs": int(re.search(r"REG:(\d+)", res).group(1)),
                "spill": int(re.search(r"STACK:(\d+)", res).group(1))
                         + int(re.search(r"LOCAL:(\d+)", res).group(1)),
                "smem": int(k.metadata.shared)})
print(json.dumps({"triton": triton.__version__, "results": out}))
"""


def compile_sm90(kernels_: list[Kernel], python: str) -> tuple[str, list[dict]]:
    """Compile each kernel for cuda:90 in a child `python` that imports triton."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for i, k in enumerate(kernels_):
            path = pathlib.Path(tmp) / f"{i:03d}_{k.name}.ttir"
            path.write_text(k.ttir)
            jobs.append({"path": str(path), "warps": k.num_warps, "stages": k.num_stages})
        done = subprocess.run([python, "-c", COMPILE], input=json.dumps(jobs), text=True,
                              capture_output=True)
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-3:]
        raise SystemExit(f"Error: compiling with {python} failed (is triton installed there? "
                         f"pip install triton): {' / '.join(tail)}")
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    return reply["triton"], reply["results"]


def occupancy(regs: int, smem: int, warps: int) -> tuple[int, str]:
    """Programs resident per SM on an H100 and the resource that limits them."""
    per_warp = -(-regs * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    limits = {"regs": REGS_PER_SM // (per_warp * warps),
              "smem": SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA),
              "warps": MAX_WARPS_PER_SM // warps, "ctas": MAX_CTAS_PER_SM}
    name = min(limits, key=limits.get)
    return limits[name], name


def table(kernels_: list[Kernel], results: list[dict]) -> list[str]:
    head = (f"| {'case':<22} | {'kernel':<32} | warps | stages | wgmma | mma.sync | cp.async | "
            "regs | spill | smem KiB | CTAs/SM |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for k, r in zip(kernels_, results):
        if "error" in r:
            lines.append(f"| {k.case:<22} | {k.name:<32} | {k.num_warps:>5} | {k.num_stages:>6} "
                         f"| {r['error']} |")
            continue
        ctas, limit = occupancy(r["regs"], r["smem"], k.num_warps)
        lines.append(
            f"| {k.case:<22} | {k.name:<32} | {k.num_warps:>5} | {k.num_stages:>6} | "
            f"{r['wgmma']:>5} | {r['mma_sync']:>8} | {r['cp_async']:>8} | {r['regs']:>4} | "
            f"{r['spill']:>5} | {r['smem'] / 1024:>8.0f} | {ctas:>3} ({limit}) |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--tiles", nargs="*", default=["64,64", "128,64", "64,128", "128,128"],
                        help="attention tiles q,kv (the backward uses the same)")
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 3])
    parser.add_argument("--no-ops", action="store_true", help="attention only")
    parser.add_argument("--python", default=os.environ.get("TRITON_PYTHON", sys.executable),
                        help="a Python with triton installed ($TRITON_PYTHON; default: this one)")
    args = parser.parse_args(argv)
    tiles = [tuple(int(t) for t in spec.split(",")) for spec in args.tiles]
    found = attention_cases(args.head_dims, tiles, args.warps, args.stages)
    if not args.no_ops:
        found += op_cases()
    seen, unique = set(), []
    for k in found:  # the same kernel from two configurations is compiled once
        key = (k.name, k.ttir, k.num_warps, k.num_stages)
        if key not in seen:
            seen.add(key)
            unique.append(k)
    import jax

    version, results = compile_sm90(unique, args.python)
    print(f"sm_90 offline compile: standalone Triton {version}, IR from jax {jax.__version__} "
          f"(Pallas Triton lowering); H100 limits per SM: {REGS_PER_SM} registers, "
          f"{SMEM_PER_SM // 1024} KiB shared memory, {MAX_WARPS_PER_SM} warps")
    print("\n".join(table(unique, results)))


if __name__ == "__main__":
    main()
