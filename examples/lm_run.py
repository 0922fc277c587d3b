"""The bookkeeping of examples/train_lm.py: checkpoints, rates, the progress bar, the curves.

- `Checkpoints`: orbax; a saved step holds `state` (params and optimizer states, any pytree)
  and `data` (JSON: the step and the pipeline iterator's `get_state()`), written together.
- `Meter`: real tokens, steps, wall time and the time spent waiting for input.
- `Progress`: a rich progress bar on a terminal, plain lines otherwise.
- `write_curves`: loss curves as a CSV and an overlaid PNG (matplotlib).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import numpy as np


class Checkpoints:
    """orbax: each saved step holds `state` (the models' params and optimizer states) and
    `data` (JSON: the step and the pipeline iterator's get_state())."""

    def __init__(self, directory: str):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.manager = ocp.CheckpointManager(
            pathlib.Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False))

    def save(self, step: int, states: dict, iterator) -> None:
        ocp = self.ocp
        meta = json.loads(json.dumps({"step": step, "iterator": iterator.get_state()},
                                     default=_json_default))
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(states),
                                                        data=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, states: dict, iterator) -> tuple[dict, int] | None:
        """(states, step) of the latest checkpoint, the iterator set to its state; None if
        there is none."""
        step = self.manager.latest_step()
        if step is None:
            return None
        ocp = self.ocp
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, states)
        got = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        iterator.set_state(got["data"]["iterator"])
        return got["state"], int(got["data"]["step"])

    def close(self) -> None:
        self.manager.close()


def _json_default(x):
    if isinstance(x, np.integer | np.floating):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} of the iterator state as JSON")


class Meter:
    """Real tokens, steps, wall time and input wait from `start()` on (the first step, which
    compiles, is left out by starting after it); `exclude` takes time out (a checkpoint)."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.tokens = self.steps = 0
        self.wait = self.excluded = 0.0

    def start(self) -> None:
        self.t0, self.tokens, self.steps = time.perf_counter(), 0, 0
        self.wait = self.excluded = 0.0

    def add(self, tokens: int, wait: float) -> None:
        if self.t0 is not None:
            self.tokens, self.steps = self.tokens + tokens, self.steps + 1
            self.wait += wait

    def exclude(self, secs: float) -> None:
        self.excluded += secs

    def rates(self) -> dict[str, float]:
        secs = time.perf_counter() - self.t0 - self.excluded if self.t0 is not None else 0.0
        if secs <= 0 or not self.steps:
            return {"tokens_per_s": 0.0, "steps_per_s": 0.0, "input_wait": 0.0, "seconds": 0.0}
        return {"tokens_per_s": self.tokens / secs, "steps_per_s": self.steps / secs,
                "input_wait": self.wait / secs, "seconds": secs}


class Progress:
    """A rich progress bar on a terminal; plain lines otherwise."""

    def __init__(self, total: int, done: int):
        self.bar = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                           TimeRemainingColumn(), TextColumn("{task.description}"))
            self.task = self.bar.add_task("", total=total, completed=done)
            self.bar.start()

    def update(self, done: int, line: str | None, short: str = "") -> None:
        """`done` steps; `line` logged (printed above the bar), `short` beside the bar."""
        if self.bar is None:
            if line:
                print(line, flush=True)
            return
        self.bar.update(self.task, completed=done, description=short)
        if line:
            self.bar.console.print(line, highlight=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def write_curves(path: str, history: dict[str, list[float]], first: int) -> None:
    """The loss curves as a CSV (step, one column per feed) and a PNG, overlaid."""
    png = pathlib.Path(path)
    feeds = list(history)
    steps = np.arange(first + 1, first + 1 + len(history[feeds[0]]))
    rows = ["step," + ",".join(f"{f}_loss" for f in feeds)]
    rows += [f"{s}," + ",".join(f"{history[f][i]:.6f}" for f in feeds)
             for i, s in enumerate(steps)]
    png.with_suffix(".csv").write_text("\n".join(rows) + "\n")
    try:
        import matplotlib
    except ImportError:
        print(f"wrote {png.with_suffix('.csv')}; no plot: pip install matplotlib", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for f, style in zip(feeds, ("-", "--")):
        ax.plot(steps, history[f], style, label=f"{f} rows")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per token)")
    ax.set_title("the same examples, packed and padded")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png} and {png.with_suffix('.csv')}", flush=True)
