"""The bookkeeping of examples/train_lm.py: checkpoints, rates, the progress bar, the curves.

- `Checkpoints`: orbax; a saved step holds `state` (params and optimizer states, any pytree)
  and `data` (JSON: the step and the pipeline iterator's `get_state()`), written together.
- `Meter`: real tokens, steps, wall time and the time spent waiting for input.
- `Progress`: a rich progress bar on a terminal, plain lines otherwise.
- `Log`: each feed's losses a step, the rates and the log lines of a run.
- `dataset_means`, `fmt_loss`, `summary_json`: each dataset's loss (NaN where it had no
  tokens: "n/a" in the log, null in the JSON summary).
- `write_curves`: loss curves as a CSV and an overlaid PNG (matplotlib).
- `json_default`: the iterator state as JSON (examples/train_tiny_lm.py's checkpoints too).
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
                                     default=json_default))
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


def json_default(x):
    """`json.dumps`'s `default` for a Grain iterator's get_state() (both example trainers):
    numpy scalars and arrays as numbers and lists, bytes as latin-1 text."""
    if isinstance(x, np.integer | np.floating):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, bytes):
        return x.decode("latin-1")
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


class Log:
    """Each feed's figures a step (`history`: the loss; `per_dataset`: each dataset's loss),
    the rates (`meter` from the end of the run's first step, which compiles; `window` since
    the last logged line) and the log lines: every `log_every` steps, the first and the last."""

    def __init__(self, feeds: list[str], names: list[str], *, steps: int, first: int,
                 stop: int, log_every: int):
        self.feeds, self.names, self.steps = feeds, names, steps
        self.first, self.stop, self.log_every = first, stop, log_every
        self.history: dict[str, list[float]] = {f: [] for f in feeds}
        self.per_dataset: dict[str, list] = {f: [] for f in feeds}
        self.meter, self.window = Meter(), Meter()
        self.progress = Progress(steps, first)

    def record(self, done: int, metrics: dict, tokens: int, wait: float) -> None:
        """Step `done`'s metrics (per feed: loss, per-dataset sums and tokens), its real tokens
        and its input wait."""
        for f in self.feeds:
            m = jax.device_get(metrics[f])
            self.history[f].append(float(m["loss"]))
            self.per_dataset[f].append(dataset_means(m["sums"], m["tokens"]))
        self.meter.add(tokens, wait)
        self.window.add(tokens, wait)
        line = None
        if self.log_every and (done % self.log_every == 0 or done in (self.first + 1, self.stop)):
            line = self._line(done)
        if done == self.first + 1:  # the first step compiled: rates from here on
            self.meter.start()
        if line or done == self.first + 1:
            self.window.start()
        self.progress.update(done, line,
                             " ".join(f"{f} {self.history[f][-1]:.4f}" for f in self.feeds))

    def _line(self, done: int) -> str:
        r = self.window.rates()
        line = f"step {done:5d}/{self.steps}"
        for f in self.feeds:
            per = " ".join(f"{n} {fmt_loss(v, 3)}"
                           for n, v in zip(self.names, self.per_dataset[f][-1]))
            line += f"  {f} loss {self.history[f][-1]:.4f} ({per})"
        return line + (f"  {r['tokens_per_s'] / 1e3:,.1f}k real tok/s  input wait "
                       f"{r['input_wait']:.1%}" if done > self.first + 1 else "  (compiled)")

    def exclude(self, secs: float) -> None:
        """Takes `secs` (a checkpoint's save) out of the rates."""
        for m in (self.meter, self.window):
            m.exclude(secs)


def dataset_means(sums, tokens) -> list[float]:
    """Each dataset's per-token loss: its loss sum over its tokens; NaN for a dataset with no
    tokens in the batch (no figure, not a loss of 0)."""
    sums, tokens = np.asarray(sums, np.float64), np.asarray(tokens)
    return np.where(tokens > 0, sums / np.maximum(tokens, 1), np.nan).tolist()


def fmt_loss(value: float, digits: int = 4) -> str:
    """A loss for a log line: "n/a" where there is none (NaN: no tokens)."""
    return "n/a" if np.isnan(value) else f"{value:.{digits}f}"


def summary_json(out: dict) -> str:
    """A run's figures as JSON: NaN and infinities (no tokens, or a diverged loss) as null
    (strict JSON has no NaN)."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        if isinstance(x, float) and not np.isfinite(x):
            return None
        return x

    return json.dumps(clean(out), indent=1, allow_nan=False)


def write_curves(path: str, history: dict[str, list[float]], first: int) -> None:
    """The loss curves as a CSV (step, one column per feed) and a PNG, overlaid (the folder
    made if missing)."""
    png = pathlib.Path(path)
    png.parent.mkdir(parents=True, exist_ok=True)
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
