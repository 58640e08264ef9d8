"""Every on-disk format eaglet reads or writes, each reader beside its writer.

Files on disk are the contract between pipeline stages, so their layout lives here and
nowhere else:

- `io`: how any file is written (atomically: temp file in the same folder, then `os.replace`, so
  a reader sees a complete file or none, whatever moment a writer is killed at) and read (JSON,
  `.pt` with the weights-only loader, safetensors), and what a failed write says;
- `prepared`: the *prepared* dataset (`eaglet prepare`): `prepared.jsonl` (one tokenized chat per
  line), `prepare_config.json`, `token_freq.pt`; and the regenerated chats of `eaglet regen`;
- `layouts`: the hidden-state dataset layouts, one `Layout` object each in `LAYOUTS`: speculators'
  "v1" (`eaglet extract`), its current Arrow layout (`--layout speculators`), the foreign ones
  `eaglet check` and `eaglet train` read (flat v1, SpecForge, `hs_*.safetensors`), and eaglet's
  compact one (`compact`: 6-bit aux states and the target's top-K in place of the last state);
  speculators' own two (`hs_*.safetensors`, the Arrow table) are read and written in
  `speculators_files`; `samples` holds what they share, `listing` how their files are found;
  `signatures` each written file's per-slot signature, recorded beside the files;
- `drafters`: drafter folders for the serving engines (`eaglet export` / `eaglet import`): the
  speculators (vLLM) and EAGLE-3 / SGLang `config.json` layouts and their weight names;
  `gguf_drafter`: the one-file GGUF drafter llama.cpp's eagle3 loader reads; `gguf_target`: the
  target's own GGUF (its weight type, and its f32 copy, the weights eaglet's target has).

Callers use the names re-exported here (`formats.read_json`, `formats.layout(name)`, ...): the ones
code outside the package uses, no more; anything else is reached through its module.
"""

from eaglet.formats.io import (
    OUTPUT_MARKER,
    PICKLED_CODE_MARKERS,
    TMP_MARK,
    OutputBusy,
    WriteFailed,
    atomic_dir,
    atomic_path,
    claim_output,
    inside_folder,
    make_output,
    refuse_other_sharding,
    refuse_overlap,
    lock_path,
    os_error_reason,
    output_lock,
    read_json,
    read_jsonl_log,
    read_safetensors,
    read_weight_index,
    remove_stale_temp_files,
    torch_load_safe,
    torch_save_atomic,
    weights_only_refusal,
    write_json_atomic,
    write_text_atomic,
)
from eaglet.formats.prepared import (
    PREPARED_FILE,
    PREPARE_CONFIG_FILE,
    PreparedWriter,
    RegenWriter,
    TOKEN_FREQ_FILE,
    TokenizedSample,
    check_prepared_token_ids,
    claim_errors_report,
    errors_path,
    open_output,
    prepared_problem,
    read_prepared,
    read_token_freq,
    refuse_mixed_regen,
    write_token_freq,
)
from eaglet.formats.samples import (
    AUX_CODES,
    DATA_CONFIG_FILE,
    EAGLE3_NUM_STATES,
    FileStates,
    HIDDEN_STATES_DIR,
    LAST_STATE_CONVENTIONS,
    LAST_STATE_POST_NORM,
    LAST_STATE_PRE_NORM,
    LAYER_ID_CONVENTION,
    ROWS_PER_FOLDER,
    SAMPLE_LENGTHS_FILE,
    StoredTeacher,
    TABLE_ROW,
    TrainingSample,
    WRONG_DTYPE,
    WRONG_KEYS,
    WRONG_SHAPE,
    fmt_rows,
    read_sample_lengths,
    write_sample_lengths,
)
from eaglet.formats.listing import DatasetFiles
from eaglet.formats.signatures import (
    SIGNATURES_DIR,
    TOLERANCE as SIGNATURE_TOLERANCE,
    Recorded,
    Signature,
    SignatureLog,
    SlotMismatch,
    read_signatures,
    signature_mismatches,
    state_signature,
    token_digest,
)
from eaglet.formats.data_config import (
    DataConfig,
    data_config_from,
    ensure_data_config,
    parse_data_config,
    read_data_config,
    refuse_other_dataset,
    signature_log,
    write_data_config,
)
from eaglet.formats.compact import (
    COMPACT_DIR,
    COMPACT_KEYS,
    FP6_GROUP,
    FP6_MAGNITUDES,
    FP6_MAX,
    FP6_VALUES,
    compact_checksum_problems,
    compact_checksums,
    compact_version_problem,
    compact_version_warning,
    dequantize_fp6,
    impossible_fp6_groups,
    pack_6bit,
    quantize_fp6,
    read_compact_file,
    unpack_6bit,
)
from eaglet.formats.layouts import (
    FORMAT_COMPACT,
    FORMAT_HS_SAFETENSORS,
    FORMAT_SPECFORGE,
    FORMAT_SPECULATORS_ARROW,
    FORMAT_V1,
    FORMAT_V1_FLAT,
    Layout,
    V1Sample,
    V1_LAYOUT,
    WRITTEN_LAYOUTS,
    files_dir,
    find_layout,
    layout,
    list_dataset_files,
    list_v1_files,
    read_sample_tokens,
    read_specforge_sample,
    read_training_sample,
    read_v1_sample,
    refuse_other_samples,
    sample_file_problem,
    sample_path,
    specforge_relative_path,
    start_dataset,
    v1_min_bytes_per_token,
    v1_relative_path,
    write_sample,
    write_v1_sample,
    written_layout,
)
from eaglet.formats.speculators_files import (
    ARROW_STATE_FILE,
    read_hs_safetensors_sample,
    read_speculators_rows,
    speculators_hs_path,
    write_hs_safetensors_sample,
    write_speculators_rows,
    write_speculators_sample,
)
from eaglet.formats.gguf_drafter import GGUF_SUFFIX, gguf_unservable, write_gguf_drafter
from eaglet.formats.gguf_target import UNQUANTIZED, GGUFDamaged, is_quantized, read_gguf, weight_type, write_gguf_as
from eaglet.formats.drafters import (
    DFLASH_ARCHITECTURE,
    DRAFTER_CONFIG_FILE,
    DRAFTER_WEIGHTS_FILE,
    DTYPE_NAMES,
    FORMAT_EAGLE,
    FORMAT_EAGLET,
    FORMAT_GGUF,
    FORMAT_SPECULATORS,
    IGNORABLE_WEIGHT_SUFFIXES,
    build_dflash_config,
    build_eagle_config,
    build_parallel_speculators_config,
    build_speculators_config,
    detect_drafter_format,
    format_name,
    from_format_names,
    parse_eagle_config,
    parse_engine_config,
    parse_speculators_config,
    read_weight_files,
    to_format_names,
    weight_files,
    write_drafter_files,
    write_drafter_folder,
)
from eaglet.formats.vllm_states import read_vllm_states
