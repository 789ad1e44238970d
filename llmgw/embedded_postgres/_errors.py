"""The two errors of the embedded server beyond llmgw.errors' ConfigError (bad setting, no binaries)."""

from __future__ import annotations

from llmgw.errors import ConflictError, LlmgwError

__all__ = ["DataDirInUseError", "PostgresStartError"]


class PostgresStartError(LlmgwError):
    """The server could not be initialised, started or reached; the message carries its log tail."""

    code = "postgres-start-failed"


class DataDirInUseError(ConflictError):
    """Another live process holds the data dir's postmaster.pid; starting would corrupt it."""

    def __init__(self, message: str, *, pid: int) -> None:
        super().__init__(message, field="data_dir")
        self.pid = pid
