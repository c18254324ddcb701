"""Every user-facing error type, in one place at the bottom of the import graph.

Each is a ValueError (bad input, not a bug), so `stx` reports it as one message and exits 2. The
message names the file, key or value and what would be valid. Nothing here imports the package.
"""

from __future__ import annotations


class StxError(ValueError):
    """Base of the errors below: bad input the user can fix, reported without a traceback."""


class ConfigError(StxError):
    """A config the user wrote (file, preset or override) is invalid; the message says how."""


class CheckpointError(StxError):
    """A checkpoint that cannot be saved or loaded, with what is wrong in the message."""


class MFUError(StxError):
    """MFU or HFU above 100% of the peak: the inputs are inconsistent (a bug, not a result)."""


class PreprocessError(StxError):
    """Bad preprocess input: a missing or empty input, undecodable bytes, a malformed JSON line..."""


class IndexedDatasetError(StxError):
    """A .bin/.idx pair that is missing, truncated or inconsistent, or holds ids outside a vocab."""


class StoreError(StxError):
    """A file that is not a results store of ours, or of a newer schema."""


class LogFormatError(StxError):
    """A log with none of the lines the chosen format prints."""


class SweepError(StxError):
    """A sweep file that cannot be run: names the file, the key and what is valid."""


class UsageError(StxError):
    """A command-line option with a value that is not valid; the message names the option."""


class StxWarning(UserWarning):
    """Something the user should know that does not stop the command; `stx` prints it as one line."""


class ConfigWarning(StxWarning):
    """A config key accepted and ignored (`key`, from `source`, for `reason`); grouped when many."""

    def __init__(self, source: str, key: str, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"{source}: '{key}' {reason}; ignored")
        self.source, self.key, self.reason = source, key, reason


class LaunchError(StxError):
    """A job that cannot be started as asked: a scheduler environment with a variable missing, a bad
    hostfile, a scheduler command that refused the job; the message says what to set or change."""


class NonFiniteError(StxError):
    """Training stopped on a non-finite loss or gradient norm (train.on_nonfinite); names the step."""
