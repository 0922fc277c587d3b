"""Draws docs/figures/packed_row.png: three examples packed into one row of the row contract.

    python docs/figures/packed_row.py [OUT.png]      # needs matplotlib (seqpack[plotting])

The row is packed by seqpack itself (`pack`), so the picture shows what the packer writes.
"""

from __future__ import annotations

import pathlib
import sys

from seqpack.packer import PackConfig, pack

EXAMPLES = [[101, 7592, 2088, 999, 102], [101, 2129, 102], [101, 2023, 2003, 1037, 3231, 102]]
L, S = 16, 4
COLORS = ["#e8e8e8", "#8ecae6", "#ffb703", "#90be6d", "#f28482"]  # padding, segments 1..4


def draw(out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = {k: v[0] for k, v in pack(EXAMPLES, PackConfig(L, max_segments=S)).items()}
    ids = row["tokens_segment_ids"]
    lines = [("tokens", row["tokens"]), ("tokens_segment_ids", ids),
             ("tokens_positions", row["tokens_positions"])]
    fig, ax = plt.subplots(figsize=(11, 3.9))
    for y, (name, values) in enumerate(lines):
        for x, v in enumerate(values.tolist()):
            ax.add_patch(plt.Rectangle((x, -y), 1, 0.9, color=COLORS[int(ids[x])], lw=0))
            ax.text(x + 0.5, -y + 0.45, str(v), ha="center", va="center",
                    fontsize=8 if name == "tokens" else 10)
        ax.text(-0.3, -y + 0.45, name, ha="right", va="center", fontsize=10, family="monospace")
    meta = [("tokens_segment_lengths", row["tokens_segment_lengths"]),
            ("tokens_segment_offsets", row["tokens_segment_offsets"]),
            ("segment_source_index", row["segment_source_index"])]
    for k, (name, values) in enumerate(meta):
        y = -3.6 - k
        for j, v in enumerate(values.tolist()):
            used = row["tokens_segment_lengths"][j] > 0
            ax.add_patch(plt.Rectangle((j * 2, y), 2, 0.9, color=COLORS[j + 1 if used else 0],
                                       lw=0))
            ax.text(j * 2 + 1, y + 0.45, str(v), ha="center", va="center", fontsize=10)
        ax.text(-0.3, y + 0.45, name, ha="right", va="center", fontsize=10, family="monospace")
    ax.text(L / 2, 1.25, f"one packed row: L = {L} tokens, S = {S} segment slots "
            "(three examples, then padding)", ha="center", fontsize=11)
    ax.text(2 * S + 0.4, -3.15, "[S] arrays: one slot per segment; an unused", ha="left",
            va="center", fontsize=9, color="#555")
    ax.text(2 * S + 0.4, -3.65, "slot has length 0 (offset: the used length)", ha="left",
            va="center", fontsize=9, color="#555")
    ax.set_xlim(-5.2, L + 0.2)
    ax.set_ylim(-5.8, 1.8)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else
         pathlib.Path(__file__).with_suffix(".png"))
