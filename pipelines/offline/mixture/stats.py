"""What `seqpack stats` shows of a mixture: each dataset's share of the rows' tokens, per step
and in all."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

_SHOWN = ("name", "weight", "tokens", "loss_tokens", "examples", "repetitions")


def shares(record: Mapping, tokens: np.ndarray, step_rows: int | None) -> dict:
    """The stats of a mixture: per dataset what the manifest records, its share of the rows'
    tokens and the p5 / p50 / p95 of its share per step of `step_rows` rows (full steps; the
    whole output when it holds less than a step) or per row (None); `tokens`:
    `packer.mixing.row_units` (in tokens) of every row, in output order."""
    step = step_rows or 1
    n = tokens.shape[0] // step
    return step_shares(record, tokens[: n * step].reshape(n, step, tokens.shape[1]).sum(axis=1),
                       tokens.sum(axis=0), step_rows)


def step_shares(record: Mapping, steps: np.ndarray, total: np.ndarray, step_rows: int | None
                ) -> dict:
    """`shares` from each full step's tokens of each dataset (`steps` [n, K]; n = 0: the output
    holds less than a step) and every row's (`total` [K])."""
    n = steps.shape[0]
    if not n:
        steps = np.asarray(total)[None]
    share = steps / np.maximum(steps.sum(axis=1, keepdims=True), 1)
    p5, p50, p95 = np.percentile(share, [5, 50, 95], axis=0)
    whole = max(1, int(total.sum()))
    datasets = [{**{k: d[k] for k in _SHOWN}, "token_share": round(float(t / whole), 6),
                 "step_share": {"p5": round(float(a), 6), "p50": round(float(b), 6),
                                "p95": round(float(c), 6)}}
                for d, t, a, b, c in zip(record["datasets"], total, p5, p50, p95)]
    return {"unit": record["unit"], "step_rows": step_rows, "steps": max(n, 1),
            "whole": not n, "datasets": datasets}


def table(mix: Mapping) -> str:
    """A mixture's stats (`shares`, or a manifest's record) as lines of text."""
    per = mix.get("step_rows")
    head = f"mixture in {mix['unit'].replace('_', ' ')}"
    if "steps" in mix:
        count = "the whole output: less than a step" if mix.get("whole") else f"{mix['steps']:,}"
        head += f"; share of tokens per {f'step of {per} rows' if per else 'row'}" \
                f" ({count}): p5 / p50 / p95"
    lines = [head, f"{'dataset':<16}{'weight':>8}{'tokens':>14}{'loss tokens':>14}"
                   f"{'examples':>11}{'repeated':>10}{'share':>9}  per step"]
    total = sum(int(d["tokens"]) for d in mix["datasets"]) or 1
    for d in mix["datasets"]:
        share = d.get("token_share", d["tokens"] / total)
        s = d.get("step_share")
        spread = "" if s is None else \
            f"  {s['p5']:.1%} / {s['p50']:.1%} / {s['p95']:.1%}"
        lines.append(f"{d['name'][:15]:<16}{d['weight']:>8.1%}{d['tokens']:>14,}"
                     f"{d['loss_tokens']:>14,}{d['examples']:>11,}{d['repetitions']:>9.2f}x"
                     f"{share:>9.1%}{spread}")
    return "\n".join(lines)
