"""`stx`: command parsing and dispatch only; the work happens in the library modules the commands call.

One module per command: it turns the parsed arguments into a typed options object, calls the
library with it and renders what comes back (console text, JSON); its parser is in cli/parsers.py,
which imports argparse only, and the module itself is imported when its command runs. Here: the
top-level parser, and the error handling and exit codes common to every command.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import NoReturn

from ..errors import CheckpointError, ConfigError, NonFiniteError, StxError, StxWarning
from . import parsers

EPILOG = """Examples:
  stx train
  stx train tiny-gpt model.num_layers=4 optim.lr=3e-4
  stx launch -n 2 train tiny-gpt
  stx launch --hostfile hosts train gpt-1b
  stx submit --scheduler slurm --nodes 2 --gpus-per-node 4 --time 2:00:00 train gpt-1b
  stx config show bert-345m
  stx tokenizer train --input corpus.jsonl --type wordpiece --vocab-size 30522 --output tok/
  stx preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer tok/tokenizer.json
  stx plan bert-175b --nodes 8 --gpus-per-node 8 --device a100-40gb --search
  stx calibrate tiny-gpt --output profile.yaml
  stx flops --config gpt-1b --tokens-per-second 30000 --devices 8 --device a100-80gb --dtype bf16
  stx sweep sweep.yaml
  stx report results.sqlite --output report/"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stx",
        description="Pretrain BERT/GPT with any parallel layout "
        "from one config; measure and compare layouts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # The order of `stx --help`; launch's SUBCOMMAND accepts every command, whatever the order.
    commands = (
        parsers.register_train,
        parsers.register_config,
        parsers.register_tokenizer,
        parsers.register_preprocess,
        parsers.register_flops,
        parsers.register_plan,
        parsers.register_calibrate,
        parsers.register_checkpoint,
        parsers.register_export,
        parsers.register_env,
        parsers.register_sweep,
        parsers.register_report,
        parsers.register_launch,
        parsers.register_submit,
    )
    for register in commands:
        register(sub)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Our warnings as one `stx: warning:` line each (no source line quoted); others as Python shows them."""
    ours = issubclass(category, StxWarning) or f"{os.sep}scalable_transformer{os.sep}" in str(filename)
    if not ours:
        _python_show_warning(message, category, filename, lineno, file, line)
        return
    with contextlib.suppress(OSError):  # a closed stderr must not turn a warning into a failure
        print(f"stx: warning: {message}", file=sys.stderr if file is None else file)


_python_show_warning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():
        # DeprecationWarnings come from inside torch (torch.jit on every checkpoint save): users can do
        # nothing about them. Every warning of ours is shown, each time it is raised, as one line.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("always", category=StxWarning)
        warnings.showwarning = _show_warning
        return _main(argv)


def entry(run: Callable[[], int | None] | None = None) -> NoReturn:
    """The `stx` executable (and `python -m scalable_transformer.cli`): `main`, then exit with its status.

    A process that started a process group finishes Python's own shutdown here (non-daemon threads
    joined, cycles collected, atexit callbacks run, stdout/stderr flushed) and then leaves with
    `os._exit`, skipping only the interpreter's module teardown and C++ static destructors, which
    abort on the torch backend threads still alive then (see
    `parallel.distributed.native_threads_may_outlive_python`). Other commands exit as usual.
    """
    code: str | int | None
    try:
        code = (run or main)()
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    status = 0 if code is None else int(code)
    distributed = sys.modules.get("scalable_transformer.parallel.distributed")
    if distributed is None or not distributed.native_threads_may_outlive_python():
        sys.exit(status)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    gc.collect()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not change the exit status
            stream.flush()
    os._exit(status)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGUSR1 (a scheduler's time limit, `kill`) outside training (train.resilience
    handles them there): unwinds like Ctrl-C (children stopped, files closed), then stx says which
    signal stopped it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


class EarlyStopRequest:
    """SIGUSR1 while `stx train` is not training (Trainer.fit handles it there): kept instead of
    ending the process. Installed before the command's module (and torch) is imported: a scheduler's
    `--signal=USR1@...` may come while a job still starts (Slurm sends it up to a minute early; a
    rank's imports took over 20 s on a loaded machine), and a rank that died of it (exit 138) ended a
    requeue chain. cli/train.py hands a request caught before the first step to the trainer (the run
    stops after that step, with its checkpoint); one caught after the last step changes nothing."""

    def __init__(self) -> None:
        self.signum = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The command line, with overrides allowed after options as well as before them (`stx plan
    gpt-13b --world-size 64 parallel.tp=4`): argparse's nargs="*" positional stops at the first option,
    so what follows it is added to the command's CONFIG|key=value items here."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not isinstance(getattr(args, "items", None), list) or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.items += extra
    return args


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"] and not {"-h", "--help"} & set(argv[1:2]):
        # `stx report` has three forms with their own options (see REPORT_USAGE): parsed in cli/report.py.
        args = argparse.Namespace(fn=parsers.command("report", "run"), args=argv[1:])
    else:
        args = parse_command_line(argv)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        handlers: dict[int, Callable[[int, object], None]] = {sig: _terminate for sig in STOP_SIGNALS}
        if getattr(args, "keeps_usr1", False):  # `stx train`: a stop request, see EarlyStopRequest
            args.early_stop = handlers[signal.SIGUSR1] = EarlyStopRequest()
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        return args.fn(args)
    except Terminated as e:
        name = signal.Signals(e.signum).name
        print(f"stx: terminated by {name} (a scheduler's time limit or `kill`); stopped", file=sys.stderr)
        return 128 + e.signum
    except ConfigError as e:
        print(f"stx: config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"stx: checkpoint error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # training diverged: not bad input, and not a crash either
        print(f"stx: stopped: {e}", file=sys.stderr)
        return 3
    except StxError as e:  # bad input with a message that says what to change: no traceback hint
        print(f"stx: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        # Bad input (a dataset, a tokenizer file, a blend) is reported as a message, not a traceback;
        # STX_DEBUG=1 re-raises for the full stack when the message is not enough.
        if os.environ.get("STX_DEBUG"):
            raise
        print(f"stx: error: {e}\n(set STX_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `stx ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
