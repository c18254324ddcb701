"""`python -m scalable_transformer.cli`: what `stx launch` runs on every rank."""

import os

from . import entry, main

# Guarded: a child that multiprocessing starts from this process (a dry run's, dryrun/dry_run.py)
# imports this module again as __mp_main__, and must not run the command a second time.
if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # Under a torchelastic agent (stx launch, torchrun), @record writes an uncaught exception to
        # the error file it names, which is how the launcher reports the failing rank's exception and
        # traceback. Imported only there: it imports torch, 2.3 of the 2.6 s that `python -m
        # scalable_transformer.cli plan ...` took to start (AMD EPYC, 2 cores; `stx plan`: 0.5 s).
        from torch.distributed.elastic.multiprocessing.errors import record

        entry(record(main))
    else:
        entry(main)
