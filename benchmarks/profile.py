"""Device time by XLA op from a jax.profiler trace, parsed in process (benchmarks/train_step.py
and benchmarks/loss_head.py --profile)."""

from __future__ import annotations

import glob
import re
import tempfile
from collections import defaultdict

import jax


def profile_ops(step_fn, params, batches, top: int) -> tuple[list[list], list[list]]:
    """Device time by XLA op over one pass of the batches, exclusive of the ops nested inside
    (a conditional holds its branch's kernel): ([category, ms a step, share], [op, ms, share])."""
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        for b in batches:
            out = step_fn(params, b)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        files = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        if not files:
            return [["(no trace written)", "-", "-"]], []
        data = jax.profiler.ProfileData.from_file(files[0])
    ops: dict[str, float] = defaultdict(float)
    device = [p for p in data.planes if p.name.startswith("/device:")]
    for plane in device or list(data.planes):
        for line in plane.lines:
            if device and line.name != "XLA Ops":
                continue
            events = sorted(((ev.start_ns, ev.duration_ns, _labelled(ev)) for ev in line.events),
                            key=lambda e: (e[0], -e[1]))
            stack: list[list] = []  # [end, name, exclusive ns]
            for start, dur, name in events:
                while stack and stack[-1][0] <= start:
                    end, done, excl = stack.pop()
                    ops[done] += excl
                if stack:
                    stack[-1][2] -= dur
                stack.append([start + dur, name, dur])
            for _, done, excl in stack:
                ops[done] += excl
    steps = len(batches)
    total = sum(ops.values()) or 1.0
    cats: dict[str, float] = defaultdict(float)
    for name, ns in ops.items():
        cats[_category(name)] += ns
    by_cat = [[c, f"{ns / 1e6 / steps:.1f}", f"{ns / total:.1%}"]
              for c, ns in sorted(cats.items(), key=lambda kv: -kv[1])]
    by_cat.append(["all device ops", f"{total / 1e6 / steps:.1f}", "100%"])
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    return by_cat, [[n[:100], f"{ns / 1e6 / steps:.2f}", f"{ns / total:.1%}"]
                    for n, ns in ranked]


def _labelled(ev) -> str:
    """The op's name, with XLA's category of it where the trace carries one ('[convolution
    fusion] fusion (bf16[..])')."""
    try:
        stats = {str(k): v for k, v in ev.stats}
    except (TypeError, ValueError, AttributeError):
        stats = {}
    cat = stats.get("hlo_category")
    return f"[{cat}] {_op_name(ev.name)}" if cat else _op_name(ev.name)


def _op_name(text: str) -> str:
    """'%fusion.54 = (f32[..]..) fusion(..), kind=..' -> 'fusion (f32[..]..)': the op's name
    without its instance number, with its result type."""
    m = re.match(r"%?([A-Za-z_\-]+?)(?:[._]\d+)*(?:\.clone(?:\.\d+)*)? = (.*)$", text)
    if not m:
        return text[:100]
    result = re.sub(r"\{[^}]*\}", "", m.group(2).split(" ")[0])[:60]
    return f"{m.group(1)} {result}"


def _category(op: str) -> str:
    for key, cat in (("convolution", "matmuls (convolution)"),) if op.startswith("[") else ():
        if key in op.split("]")[0]:
            return cat
    for key, cat in (("segment_attention", "attention kernels"), ("splash", "attention kernels"),
                     ("segment_linear_cross_entropy", "loss head kernels"),
                     ("convolution", "matmuls (convolution)"), ("fusion", "fusions"),
                     ("copy", "copies / transposes"), ("transpose", "copies / transposes"),
                     ("pad", "pads"), ("cond", "conditionals (their own time)")):
        if key in op:
            return cat
    return "other"
