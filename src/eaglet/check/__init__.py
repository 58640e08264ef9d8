"""`eaglet check DIR`: prove a hidden-state dataset is right before GPU hours go into training.

Every file is read (never a sample of them), only with `torch.load(weights_only=True)` or
safetensors, so a file that needs arbitrary pickled objects is reported, never executed.
Per file (`files`): schema (keys, dtypes, shapes), values (mask 0/1 and not empty, token ids in
range, no NaN/Inf, no all-zero rows, sane RMS). Per dataset (`dataset`): side files agree with the
files, no duplicate or missing index, folder naming. With a target (`identity`): a few sampled
files are recomputed and every stored slot is matched against every layer, so a wrong id, order
or norm convention is named ("slot 2 matches layer 28, not 27"); the loss mask is checked against
the assistant spans the chat template produces. `report` holds the kinds of problem and the report.

Entry point: `check_dataset(path, target=None, ...) -> CheckReport`.
"""

from eaglet.check.dataset import check_dataset
from eaglet.check.heads import convention_hits, convention_problem
from eaglet.check.identity import layer_identity_problems, prepared_mask_problem, template_mismatch
from eaglet.check.report import (
    ALL_ZERO,
    AUX_CODES,
    BROKEN_LINK,
    CHECKSUM,
    DATA_CONFIG,
    DUPLICATE_INDEX,
    ERROR,
    FOLDER_NAMING,
    HIDDEN_SIZE,
    LAYER_IDENTITY,
    STATE_SIGNATURE,
    LENGTH_MISMATCH,
    MASK_EMPTY,
    MASK_TEMPLATE,
    MASK_VALUES,
    MISSING_INDEX,
    NO_FILES,
    NON_FINITE,
    NOT_CHECKED,
    RMS_BOUNDS,
    SAMPLE_LENGTHS,
    STATE_COUNT,
    STORED_TEACHER,
    STRAY_FILE,
    TABLE_ROW,
    TOKEN_FREQ,
    TOKEN_RANGE,
    TOO_LONG,
    UNREADABLE,
    UNSAFE_PICKLE,
    WARNING,
    WRONG_DTYPE,
    WRONG_KEYS,
    WRONG_SHAPE,
    CheckReport,
    Problem,
    problem_lines,
)

# What callers use: the entry point, the layer-identity check train runs, the report and its kinds
# of problem. Everything else is reached through its module (check.files, check.identity, ...).
__all__ = [
    "check_dataset",
    "convention_hits",
    "convention_problem",
    "layer_identity_problems",
    "prepared_mask_problem",
    "template_mismatch",
    "CheckReport",
    "Problem",
    "problem_lines",
    "ERROR",
    "WARNING",
    "ALL_ZERO",
    "AUX_CODES",
    "BROKEN_LINK",
    "CHECKSUM",
    "DATA_CONFIG",
    "DUPLICATE_INDEX",
    "FOLDER_NAMING",
    "HIDDEN_SIZE",
    "LAYER_IDENTITY",
    "STATE_SIGNATURE",
    "LENGTH_MISMATCH",
    "MASK_EMPTY",
    "MASK_TEMPLATE",
    "MASK_VALUES",
    "MISSING_INDEX",
    "NO_FILES",
    "NON_FINITE",
    "NOT_CHECKED",
    "RMS_BOUNDS",
    "SAMPLE_LENGTHS",
    "STATE_COUNT",
    "STORED_TEACHER",
    "STRAY_FILE",
    "TABLE_ROW",
    "TOKEN_FREQ",
    "TOKEN_RANGE",
    "TOO_LONG",
    "UNREADABLE",
    "UNSAFE_PICKLE",
    "WRONG_DTYPE",
    "WRONG_KEYS",
    "WRONG_SHAPE",
]
