"""`python -m scalable_transformer.cli`: what `stx launch` runs on every rank."""

from torch.distributed.elastic.multiprocessing.errors import record

from . import entry, main

# @record writes an uncaught exception to the error file torchelastic names (TORCHELASTIC_ERROR_FILE;
# a no-op without it), which is how the launcher reports the failing rank's exception and traceback.
entry(record(main))
