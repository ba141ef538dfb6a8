"""One error type for everything a user can fix: the CLI prints its message on one line and exits 2."""


class LorafitError(Exception):
    """A problem with the user's input or environment, worded so the user can act on it."""

    exit_code = 2


class UnknownModel(LorafitError):
    pass


class UnknownGpu(LorafitError):
    pass


class InvalidConfig(LorafitError):
    pass


class DataError(LorafitError):
    pass


class TrainError(LorafitError):
    pass


class ExportError(LorafitError):
    pass
