"""What the sidecar and the middleware agree on: the load snapshot, its codec, config helpers."""

from ._config import ConfigError, Redacted, parse_duration
from ._errors import SnapshotError
from ._kv import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    BYTES_PER_TOKEN,
    block_hashes,
    first_ids,
    prompt_bytes,
    prompt_tokens,
)
from ._prompt import prompt_prefix, prompt_turns
from ._signing import FreshnessCheck, SigningKey, decode, encode, load_key_file, load_keys
from ._snapshot import (
    EPOCHS_V,
    MAX_AGE_MS,
    MAX_SNAPSHOT_BYTES,
    SCHEMA_VERSION,
    SEQ_EPOCH_BITS,
    EngineSample,
    GpuSample,
    Snapshot,
)

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_TOKENS",
    "BYTES_PER_TOKEN",
    "EPOCHS_V",
    "MAX_AGE_MS",
    "MAX_SNAPSHOT_BYTES",
    "SCHEMA_VERSION",
    "SEQ_EPOCH_BITS",
    "ConfigError",
    "EngineSample",
    "FreshnessCheck",
    "GpuSample",
    "Redacted",
    "SigningKey",
    "Snapshot",
    "SnapshotError",
    "block_hashes",
    "decode",
    "encode",
    "first_ids",
    "load_key_file",
    "load_keys",
    "parse_duration",
    "prompt_bytes",
    "prompt_prefix",
    "prompt_tokens",
    "prompt_turns",
]
