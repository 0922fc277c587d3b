"""How a `seqpack` command meets SIGINT and SIGTERM, installed before anything heavy loads.

The first signal ends the command: a KeyboardInterrupt (SIGINT) or `Terminated` (SIGTERM), which
`console.Group` turns into one `Error:` line and exit 130 or 143; later ones are ignored while it
cleans up. `run_cli` is the console script: it installs the handlers before it imports the
command (click and the rest take ~50 ms to load, during which a Ctrl-C would otherwise print a
traceback), and an interrupt while that import runs ends the same way. `exit_within` is how an
interrupted command exits. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


class Terminated(KeyboardInterrupt):
    """SIGTERM (schedulers, `timeout`, container stops), handled like Ctrl-C."""


_SIGNALLED: list[int] = []
_HANDLING: list[bool] = []  # handle_signals ran: this process is the command (not a test's)
EXIT_GRACE = 3.0  # seconds an interrupted command's exit may take before it is forced


def _on_signal(signum: int, frame: object) -> None:
    """The first SIGINT / SIGTERM ends the command (KeyboardInterrupt / Terminated); later ones
    are ignored while it cleans up (a second Ctrl-C would only add a traceback)."""
    if _SIGNALLED:
        return
    _SIGNALLED.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """A signal's interrupt raised where Python swallows exceptions (a weakref callback, a
    `__del__`: it prints "Exception ignored in ...") is sent again, to land where it ends the
    command; anything else goes to the usual hook."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _SIGNALLED:
        os.kill(os.getpid(), _SIGNALLED.pop())
        return
    sys.__unraisablehook__(unraisable)


def handle_signals() -> None:
    """SIGINT and SIGTERM end the command with its one message (`console.Group`)."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    sys.unraisablehook = _unraisable
    _HANDLING.append(True)


def interrupt_in(e: BaseException | None) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that `e` is or wraps, if any: a signal that lands while Python
    creates a class (a module loading) reaches the caller as a RuntimeError from
    `__set_name__` whose cause is the interrupt."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def exit_within(code: int) -> None:
    """Exits with `code`, running the interpreter's exit-time cleanup, but forces the exit after
    `EXIT_GRACE` seconds: an interrupt can leave a library's exit-time join waiting on what will
    never come (a worker pool's queue whose readers were killed), and a run told to stop must
    stop. Everything of the run's own was cleaned up before (its `finally` blocks). The timer
    only in the command's own process (`handle_signals`), never in a caller's."""
    import threading

    # CPython marks an interrupt raised inside exec() of a string (a dataclass or namedtuple
    # being made while a module loads) as unhandled even once caught, and then ends the process
    # with SIGINT instead of `code`; the next exec() of a string clears that mark.
    exec("None")
    if _HANDLING:
        def force() -> None:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
                sys.stdout.flush()
            os._exit(code)

        timer = threading.Timer(EXIT_GRACE, force)
        timer.daemon = True
        timer.start()
    sys.exit(code)


def run_cli() -> None:
    """The `seqpack` console script: the signal handlers, then the command (`cli.main`)."""
    handle_signals()
    try:
        from seqpack import cli
    except BaseException as e:
        interrupt = interrupt_in(e)
        if interrupt is None:
            raise
        what = "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"
        print(f"Error: {what}", file=sys.stderr)
        exit_within(143 if isinstance(interrupt, Terminated) else 130)
    cli.main()
