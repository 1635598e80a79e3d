"""Writing to disk without losing anything, under the checkpoint package's name: checksums,
atomic files, staging folders and one-line errors, as every save of shardwise uses them.

The functions live in `shardwise.weights.storage`, below both packages: a model export writes
through them too, and the checkpoint package needs the weights' own knowledge (tied names, a
model's config.json, an export's checksums), so the weights must not import this package.
`CheckpointError` is the same class under both names.
"""

from __future__ import annotations

from ..weights.storage import (
    ALGORITHM,
    STAGING_MARK,
    CheckpointError,
    WriteFailed,
    agree,
    atomic_write_text,
    check_file,
    checksum_file,
    clear_staging,
    describe_entries,
    exchange,
    fsync_path,
    inside_cwd_check,
    is_checkpoint,
    new_staging,
    one_line,
    os_error_line,
    staging_dir,
    staging_is_ours,
    write_torch,
)

__all__ = [
    "ALGORITHM", "STAGING_MARK", "CheckpointError", "WriteFailed", "agree", "atomic_write_text", "check_file",
    "checksum_file", "clear_staging", "describe_entries", "exchange", "fsync_path", "inside_cwd_check",
    "is_checkpoint", "new_staging", "one_line", "os_error_line", "staging_dir", "staging_is_ours",
    "write_torch",
]
