"""lorafit: will this fine-tune fit my GPU, with which settings, how long and at what cost - then run it."""

__version__ = "0.1.0"
