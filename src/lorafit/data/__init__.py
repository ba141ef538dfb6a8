"""Datasets: loaders, format detection and conversion, checks, and the token profile the planner uses.

For the trainer: `load_conversations(path, format=None, mapping=None)` returns the valid rows as conversations
(`.format` says which format they were read as) or raises DataError. For the planner: `counter_for(...)` (how
to count a model's tokens), `token_profile(...)`, `length_profile(...)`, `profile_of_lengths(...)` and
`truncated_rows(...)`. Importing this package stays cheap: datasets, transformers and matplotlib load only inside
the functions that use them.
"""

from lorafit.data.check import CheckReport, check
from lorafit.data.convert import ConvertReport, convert
from lorafit.data.dataset import Conversations, Dataset, detect, load_conversations
from lorafit.data.formats import FORMATS, TARGETS, Format, Messages, Target, parse_mapping
from lorafit.data.problems import Problem
from lorafit.data.profile import LengthProfile, length_profile, profile_of_lengths, token_profile, truncated_rows
from lorafit.data.tokens import CHAR_ESTIMATE_ERROR, CHARS_PER_TOKEN, counter_for

__all__ = [
    "CHARS_PER_TOKEN",
    "CHAR_ESTIMATE_ERROR",
    "FORMATS",
    "TARGETS",
    "CheckReport",
    "ConvertReport",
    "Conversations",
    "Dataset",
    "Format",
    "LengthProfile",
    "Messages",
    "Problem",
    "Target",
    "check",
    "convert",
    "counter_for",
    "detect",
    "length_profile",
    "load_conversations",
    "parse_mapping",
    "profile_of_lengths",
    "token_profile",
    "truncated_rows",
]
