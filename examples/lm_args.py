"""The flags of examples/train_lm.py: `parse_args`, checked (a bad value is one usage error
naming the flag, never a traceback later in the run).

`--smoke` sets SMOKE's sizes and SMOKE_MODEL's model for the flags the command line does not
name (`given_flags`: a flag given with its default value is given, so it stays), and without
`--data` the generated datasets (`lm_data.smoke_corpora`: count and motif), equal shares unless
`--weights` says otherwise.
"""

from __future__ import annotations

import argparse
import math
import pathlib

DESCRIPTION = ("Trains examples/lm.py on an accelerator from seqpack's pipeline: packed rows of "
               "two corpora.")
MODEL = dict(vocab=32768, dim=768, heads=6, head_dim=128, mlp=3072, layers=6)
SMOKE_MODEL = dict(vocab=256, dim=64, heads=2, head_dim=32, mlp=128, layers=2)
SMOKE = dict(seq_len=128, batch_size=4, steps=6, log_every=1, pipeline_batches=5,
             padded_min_width=32, warmup=2)  # --smoke's sizes, unless given
SMOKE_DATASETS = ("count", "motif")  # lm_data.smoke_corpora's


def at_least(low: int):
    """An argparse type: an int >= `low` (a smaller one names the flag: "argument
    --worker-buffer: 0 is not an integer >= 1")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not an integer >= {low}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model and sizes, generated data (no --data needed): seconds on "
                         "CPU; flags given explicitly still apply")
    ap.add_argument("--data", default=None,
                    help="folder of the corpora, one NAME.npz each (tokens, offsets)")
    ap.add_argument("--datasets", default="chat_dev,gsm8k_train",
                    help="one or more, by name (--smoke without --data: count and/or motif)")
    ap.add_argument("--weights", default="0.7,0.3",
                    help="each dataset's share of the tokens (--smoke: equal shares)")
    ap.add_argument("--seq-len", type=at_least(1), default=8192)
    ap.add_argument("--batch-size", type=at_least(1), default=4, help="packed rows a step")
    ap.add_argument("--max-segments", type=at_least(1), default=None,
                    help="default max(16, seq_len // 64)")
    ap.add_argument("--steps", type=at_least(0), default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=at_least(0), default=20)
    ap.add_argument("--schedule-steps", type=at_least(1), default=None,
                    help="steps of the learning-rate schedule (default --steps): runs of "
                         "different lengths on one schedule share compilations and losses")
    ap.add_argument("--seed", type=int, default=0)
    for key, value in MODEL.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=at_least(1), default=None,
                        help=f"default {value}")
    ap.add_argument("--rope", default="half", choices=["half", "interleaved"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the compute dtype (parameters stay float32)")
    ap.add_argument("--attention", default="seqpack", choices=["seqpack", "splash", "reference"],
                    help="the packed model's attention")
    ap.add_argument("--padded", action="store_true", help="train on the batches padded instead")
    ap.add_argument("--compare-steps", type=at_least(0), default=0, metavar="N",
                    help="N steps of packed and padded models in lockstep (overrides --steps)")
    ap.add_argument("--plot", help="PNG of the loss curves (+ a CSV beside it)")
    ap.add_argument("--padded-tokens", type=at_least(1), default=None,
                    help="token slots of a padded micro-batch (default min(B * L, 16384))")
    ap.add_argument("--padded-min-width", type=at_least(1), default=512)
    ap.add_argument("--workers", type=at_least(0), default=0, help="pipeline worker processes")
    ap.add_argument("--worker-buffer", type=at_least(1), default=2,
                    help="batches each worker makes ahead")
    ap.add_argument("--pipeline-batches", type=at_least(0), default=300,
                    help="batches drained without the model at the end (0: skip)")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--save-every", type=at_least(0), default=0,
                    help="save every N steps (needs --checkpoint-dir; 0: only at the end)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the latest checkpoint in --checkpoint-dir (which must "
                         "exist; an empty one starts at step 0)")
    ap.add_argument("--stop-after", type=at_least(0), default=0,
                    help="end after this many steps of this run, as if preempted (a drill; "
                         "0: run to --steps)")
    ap.add_argument("--log-every", type=at_least(0), default=10)
    ap.add_argument("--compilation-cache", help="a persistent JAX compilation cache folder")
    ap.add_argument("--summary", help="write the run's figures as JSON here")
    return ap


def given_flags(argv: list[str] | None) -> set[str]:
    """The destinations of the flags `argv` names (a flag given with its default value is
    given, so --smoke leaves it as it is): parsed into a namespace whose every value is a
    marker that only a given flag replaces."""
    ap = parser()
    unset = object()
    marked = argparse.Namespace(**dict.fromkeys(vars(ap.parse_args([])), unset))
    return {k for k, v in vars(ap.parse_args(argv, namespace=marked)).items() if v is not unset}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if args.smoke:
        smoke_defaults(ap, args, given_flags(argv))
    base = SMOKE_MODEL if args.smoke else MODEL
    args.model = {k: getattr(args, k) if getattr(args, k) is not None else v
                  for k, v in base.items()}
    if args.compare_steps and args.padded:
        ap.error("--compare-steps trains both feeds; leave out --padded")
    if args.compare_steps:
        args.steps = args.compare_steps
    args.names, args.shares = mixture_shares(ap, args.datasets, args.weights)
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        ap.error(f"{'--resume' if args.resume else '--save-every'} needs --checkpoint-dir")
    if args.resume and not pathlib.Path(args.checkpoint_dir).is_dir():
        ap.error(f"--resume: no folder {args.checkpoint_dir} (no checkpoint to resume from): "
                 "check the path, or leave out --resume to start at step 0")
    args.max_segments = args.max_segments or max(16, args.seq_len // 64)
    args.padded_tokens = args.padded_tokens or min(args.batch_size * args.seq_len, 16384)
    return args


def smoke_defaults(ap: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]):
    """--smoke: SMOKE's sizes for the flags not `given`; without --data the generated
    datasets (SMOKE_DATASETS, or those of them --datasets names), equal shares by default."""
    for key, value in SMOKE.items():
        if key not in given:
            setattr(args, key, value)
    if args.data is not None:
        return
    if "datasets" not in given:
        args.datasets = ",".join(SMOKE_DATASETS)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    unknown = [n for n in names if n not in SMOKE_DATASETS]
    if unknown:
        ap.error(f"--datasets {args.datasets}: --smoke without --data generates "
                 f"{', '.join(SMOKE_DATASETS)} only; pass --data FOLDER to read {unknown}")
    if "weights" not in given:
        args.weights = ",".join([f"{1 / max(len(names), 1):g}"] * len(names))


def mixture_shares(ap: argparse.ArgumentParser, datasets: str, weights: str
                   ) -> tuple[list[str], dict[str, float]]:
    """(names, name -> share of the tokens) of --datasets and --weights, checked."""
    names = [n.strip() for n in datasets.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        ap.error(f"--datasets {datasets!r}: name one dataset or more, each once")
    try:
        shares = [float(w) for w in weights.split(",")]
    except ValueError:
        ap.error(f"--weights {weights!r}: pass one number per dataset of {names}, "
                 f"comma-separated (e.g. {','.join(['1'] * len(names))})")
    if len(shares) != len(names):
        ap.error(f"--weights {weights} needs one share per dataset of {names}")
    if not all(math.isfinite(w) and w >= 0 for w in shares) or not sum(shares):
        ap.error(f"--weights {weights}: shares must be finite, >= 0 and not all 0")
    return names, dict(zip(names, shares))
