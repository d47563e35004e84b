"""The dataset format's definitions, shared by the file-system code (:mod:`hetflow.operators.dataset`) and
the object-store code (:mod:`hetflow.operators.objectdataset`): the manifest and its partitions, the
errors, the names of partition files (layer 0: no I/O).  Users import them from
:mod:`hetflow.operators.dataset`."""

from __future__ import annotations

import base64
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .errors import OperatorError
from .safeio import UnsafePath

MANIFEST = "_manifest.json"
FORMAT_VERSION = 1


class DatasetError(OperatorError):
    """Root of dataset errors (under the operators' root, :class:`~hetflow.operators.OperatorError`)."""


class DatasetNotFound(DatasetError, FileNotFoundError):
    """No committed dataset (no manifest) at a path."""


class CorruptDataset(DatasetError, ValueError):
    """A partition or manifest does not match what the manifest promises."""


class DatasetCommitted(DatasetError):
    """A commit found the dataset committed already (by another writer): a manifest is never overwritten."""


class UnsafeDatasetPath(DatasetError, UnsafePath):
    """A dataset path that is a symlink (or not what it must be): refused, never followed.  An
    :class:`~hetflow.operators.safeio.UnsafePath`, as every refusal of hetflow's safe file I/O."""


def entry_problem(entry: Any) -> str | None:
    """Why ``entry`` is not a plain file name inside a dataset directory (None when it is)."""
    if not isinstance(entry, str):
        return f"is a {type(entry).__name__}, not a string"
    if entry in ("", ".", ".."):
        return "is empty, '.' or '..'"
    if "\0" in entry:
        return "contains a NUL character"
    if "/" in entry or os.sep in entry or (os.altsep and os.altsep in entry):
        return "contains a path separator (absolute paths and subdirectories are not allowed)"
    return None


def check_entry(directory: "str | os.PathLike[str]", entry: Any) -> str:
    """``entry`` if it is a plain file name such as ``part-00000.arrow``; else :class:`CorruptDataset`."""
    problem = entry_problem(entry)
    if problem is not None:
        raise CorruptDataset(f"dataset {os.fspath(directory)}: partition file {entry!r} {problem}; "
                             "expected a plain file name inside the dataset directory such as 'part-00000.arrow'")
    return str(entry)


@dataclass(frozen=True)
class PartitionInfo:
    """One committed partition file (``file`` is relative to the dataset directory)."""

    file: str
    rows: int
    bytes: int
    checksum: str
    node: str = ""
    rank: int = 0

    def __post_init__(self) -> None:
        problem = entry_problem(self.file)
        if problem is not None:
            raise CorruptDataset(f"partition file {self.file!r} {problem}; expected a plain file name "
                                 "inside the dataset directory such as 'part-00000.arrow'")

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "rows": self.rows, "bytes": self.bytes,
                "checksum": self.checksum, "node": self.node, "rank": self.rank}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "PartitionInfo":
        return cls(file=str(data["file"]), rows=int(data["rows"]), bytes=int(data["bytes"]),
                   checksum=str(data["checksum"]), node=str(data.get("node", "")), rank=int(data.get("rank", 0)))


@dataclass(frozen=True)
class Manifest:
    name: str
    schema: pa.Schema
    partitions: tuple[PartitionInfo, ...]
    producer: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.partitions)

    @property
    def num_bytes(self) -> int:
        return sum(p.bytes for p in self.partitions)

    def fingerprint(self) -> str:
        """A stable digest of the content this manifest commits (for cache keys)."""
        parts = ",".join(f"{p.file}:{p.rows}:{p.bytes}:{p.checksum}" for p in self.partitions)
        text = f"{schema_to_text(self.schema)}|{parts}"
        return f"{zlib.crc32(text.encode()):08x}-{self.num_rows}-{self.num_bytes}"

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "name": self.name,
            "num_rows": self.num_rows,
            "num_bytes": self.num_bytes,
            "schema": schema_to_text(self.schema),
            "schema_fields": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in self.schema],
            "partitions": [p.to_json() for p in self.partitions],
            "producer": dict(self.producer),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str) -> "Manifest":
        try:
            return cls(
                name=str(data["name"]),
                schema=schema_from_text(str(data["schema"])),
                partitions=tuple(PartitionInfo.from_json(p) for p in data["partitions"]),
                producer=dict(data.get("producer", {})),
                format_version=int(data.get("format_version", FORMAT_VERSION)),
            )
        except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
            raise CorruptDataset(f"{source}: not a valid hetflow manifest ({exc!s})") from None


def schema_to_text(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def schema_from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def partition_name(index: int) -> str:
    return f"part-{index:05d}.arrow"


def _is_part(name: str) -> bool:
    return "part-" in name and ".arrow" in name.split("part-", 1)[1]
