"""Record datasets (issue 27): a holder's data as fixed-size records with a schema of named fields,
each a dtype and a shape (``image: uint8[1,8,8]; label: int64[]``). On disk a dataset is a
directory: ``records.npy`` (a numpy structured array) and ``schema.json``.

A holder lays its records out in manifest pieces, whole records each (zero-padded), so a chunk
is whole records and its digest stays checkable from the manifest; its held-out records follow
its training records, from a fresh piece.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from gputravel.errors import BadInput
from gputravel.files import _umask

RECORDS_FILE, SCHEMA_FILE = "records.npy", "schema.json"
DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64")
MAX_FIELDS = 64
MAX_RECORD_BYTES = 64 << 20
_BLOCK_BYTES = 64 << 20  # pieces laid out at a time
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_FIELD = re.compile(r"\s*([^:\s]+)\s*:\s*([a-z0-9]+)\s*\[([0-9,\s]*)\]\s*")


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    names: tuple[str, ...] = ()  # a label's classes, or a feature vector's columns: holders must agree

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise BadInput(f"field name {self.name!r}: expected letters, digits and _, not starting with a digit")
        if self.dtype not in DTYPES:
            raise BadInput(f"field {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if any(type(n) is not int or n <= 0 for n in self.shape) or len(self.shape) > 8:
            raise BadInput(f"field {self.name!r}: a shape is up to 8 positive sizes, got {list(self.shape)}")
        if any(not isinstance(n, str) or not n for n in self.names):
            raise BadInput(f"field {self.name!r}: its names must be non-empty strings")

    def text(self) -> str:
        return f"{self.name}: {self.dtype}[{','.join(map(str, self.shape))}]"

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "names": list(self.names)}


class _FieldDoc(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    names: list[str] = []


class _SchemaDoc(msgspec.Struct, forbid_unknown_fields=True):
    fields: list[_FieldDoc]


@dataclass(frozen=True)
class RecordSchema:
    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.fields) <= MAX_FIELDS:
            raise BadInput(f"a schema has 1 to {MAX_FIELDS} fields, got {len(self.fields)}")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise BadInput(f"a schema names each field once, got {', '.join(names)}")
        if not 0 < self.record_bytes <= MAX_RECORD_BYTES:
            raise BadInput(f"a record is 1 byte to 64 MiB, this schema's is {self.record_bytes}")

    @classmethod
    def parse(cls, text: str) -> RecordSchema:
        """``name: dtype[d0,d1]; ...`` (``[]`` a scalar), as :meth:`text` writes it."""
        fields = []
        for part in filter(str.strip, text.split(";")):
            m = _FIELD.fullmatch(part)
            if m is None:
                raise BadInput(f"schema field {part.strip()!r}: expected NAME: DTYPE[SHAPE], e.g. image: uint8[1,8,8]")
            dims = [d.strip() for d in m.group(3).split(",") if d.strip()]
            fields.append(Field(m.group(1), m.group(2), tuple(int(d) for d in dims)))
        return cls(tuple(fields))

    @classmethod
    def from_dict(cls, raw: object) -> RecordSchema:
        """Strictly: every field an object of exactly these keys and types, nothing dropped or coerced."""
        try:
            doc = msgspec.convert(raw, _SchemaDoc, strict=True)
        except msgspec.ValidationError as exc:
            raise BadInput(f"a schema is {{\"fields\": [{{\"name\", \"dtype\", \"shape\", \"names\"}}, ...]}} ({exc})") from None
        return cls(tuple(Field(f.name, f.dtype, tuple(f.shape), tuple(f.names)) for f in doc.fields))

    @classmethod
    def from_json(cls, text: str) -> RecordSchema:
        try:
            raw = json.loads(text)
        except ValueError:
            raise BadInput("a schema's JSON is malformed") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        return {"fields": [f.to_dict() for f in self.fields]}

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: what a holder announces and a job pins."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def text(self) -> str:
        return "; ".join(f.text() for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise BadInput(f"the schema has no field {name!r} ({self.text()})")

    @property
    def dtype(self) -> np.dtype:
        """The packed little-endian structured dtype of one record."""
        return np.dtype([(f.name, np.dtype(f.dtype).newbyteorder("<"), f.shape) for f in self.fields])

    @property
    def record_bytes(self) -> int:
        return self.dtype.itemsize

    def difference(self, other: RecordSchema) -> str:
        """The first field in which `other` differs from this schema, in words ("" if none)."""
        mine, theirs = {f.name: f for f in self.fields}, {f.name: f for f in other.fields}
        for name, f in mine.items():
            g = theirs.get(name)
            if g is None:
                return f"field {name!r} is missing (expected {f.text()})"
            if (g.dtype, g.shape) != (f.dtype, f.shape):
                return f"field {name!r} is {g.text()}, expected {f.text()}"
            if g.names != f.names:
                return f"field {name!r} names other classes or columns ({_short(g.names)}, expected {_short(f.names)})"
        extra = [n for n in theirs if n not in mine]
        if extra:
            return f"field {extra[0]!r} is not in the job's schema ({self.text()})"
        if [f.name for f in other.fields] != list(mine):
            return f"the fields are in another order ({other.text()}, expected {self.text()})"
        return ""


def _short(names: Sequence[str]) -> str:
    shown = ", ".join(names[:4])
    return f"{shown}, ... {len(names)} in all" if len(names) > 4 else shown or "none"


# ----------------------------------------------------------------------------- on disk
@dataclass(frozen=True, eq=False)
class Records:
    """A record dataset: its schema and its records (read-only)."""

    schema: RecordSchema
    array: np.ndarray  # structured, schema.dtype

    def __len__(self) -> int:
        return int(self.array.shape[0])


def is_record_dataset(path: Path | str) -> bool:
    return (Path(path) / SCHEMA_FILE).is_file()


def load_records(path: Path | str) -> Records:
    """The dataset in directory `path`; BadInput naming what is wrong."""
    path = Path(path)
    try:
        schema = RecordSchema.from_json((path / SCHEMA_FILE).read_text())
        array = np.load(path / RECORDS_FILE, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError as exc:
        raise BadInput(f"{path} is not a record dataset ({Path(exc.filename).name} is missing); "
                       "write one with `gputravel data pack`") from None
    except (OSError, ValueError) as exc:
        # numpy's words quote the header, which a wrong length runs into the records: the type only.
        raise BadInput(f"{path / RECORDS_FILE} is not a readable .npy file ({type(exc).__name__})") from None
    if array.dtype != schema.dtype or array.ndim != 1:
        raise BadInput(f"{path / RECORDS_FILE} does not hold records of its schema ({schema.text()})")
    if not len(array):
        raise BadInput(f"{path} holds no records")
    out = np.array(array)  # one copy in private memory; the map closes
    out.flags.writeable = False
    return Records(schema, out)


def write_records(path: Path | str, schema: RecordSchema, array: np.ndarray) -> None:
    """Write a dataset directory whole or not at all (a temporary sibling, then renamed)."""
    path = Path(path)
    array = np.ascontiguousarray(array, dtype=schema.dtype)
    if array.ndim != 1 or not len(array):
        raise BadInput(f"{path}: nothing to write (no records)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    old = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # as mkdir would: a holder's CVM reads it under its own uid
        np.save(tmp / RECORDS_FILE, array, allow_pickle=False)
        (tmp / SCHEMA_FILE).write_text(json.dumps(schema.to_dict(), indent=1) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if path.exists():
            if not is_record_dataset(path) or not set(os.listdir(path)) <= {RECORDS_FILE, SCHEMA_FILE}:
                raise BadInput(f"{path} exists and is not a record dataset alone: choose another --out")
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            old.rename(path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- held-out split
def held_out(count: int, share: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) record indices, each ascending: `share` of the records, chosen by a
    permutation seeded with `seed`, so a holder's split is its own and the same on every boot."""
    if not 0 <= share < 1:
        raise BadInput(f"a held-out share is at least 0 and below 1, got {share}")
    k = round(count * share)
    chosen = np.random.default_rng(seed).permutation(count)[:k]
    mask = np.zeros(count, dtype=bool)
    mask[chosen] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


# ----------------------------------------------------------------------------- in pieces
@dataclass(frozen=True)
class Units:
    """How a holder's dataset is cut into units (records, or tokens) inside manifest pieces: whole
    units per piece, zero-padded, so no unit is split across two chunks."""

    unit_bytes: int
    piece_bytes: int

    def __post_init__(self) -> None:
        if not 0 < self.unit_bytes <= self.piece_bytes:
            raise BadInput(f"a record of {self.unit_bytes} bytes does not fit the holder's {self.piece_bytes}-byte "
                           "manifest pieces: use larger bounce-buffer slots (layout record_bytes)")

    @property
    def per_piece(self) -> int:
        return self.piece_bytes // self.unit_bytes

    def pieces(self, units: int) -> int:
        return -(-units // self.per_piece)

    def offset(self, unit: int) -> int:
        """The byte offset of unit `unit`."""
        return (unit // self.per_piece) * self.piece_bytes + (unit % self.per_piece) * self.unit_bytes

    def span(self, units: int) -> int:
        """The bytes `units` units take laid out (:meth:`lay_out`: the last piece unpadded)."""
        whole = max(self.pieces(units) - 1, 0)
        return whole * self.piece_bytes + (units - whole * self.per_piece) * self.unit_bytes

    def eval_base(self, train: int) -> int:
        """Where the held-out units start after `train` training units: the next piece boundary."""
        return self.pieces(train) * self.piece_bytes

    def split_bytes(self, train: int, held: int) -> int:
        """The size of :func:`lay_out_split`'s bytes for `train` training and `held` held-out units."""
        return self.eval_base(train) + self.span(held) if held else self.span(train)

    def capacity(self, buffer_bytes: int) -> int:
        """Units a buffer of `buffer_bytes` holds, from a piece boundary."""
        return (buffer_bytes // self.piece_bytes) * self.per_piece

    def place(self, out: np.ndarray, base: int, array: np.ndarray, index: np.ndarray) -> None:
        """Write records `array[index]` into `out` (uint8) from byte `base`, `per_piece` to a piece, a
        block of pieces at a time: a holder's whole dataset is never copied again at once."""
        k, rec, piece = self.per_piece, self.unit_bytes, self.piece_bytes
        step = k * max(1, _BLOCK_BYTES // piece)
        for first in range(0, len(index), step):
            rows = np.ascontiguousarray(array[index[first : first + step]]).view(np.uint8).reshape(-1, rec)
            # Every piece but the block's last through one reshape; the last (the dataset's may be
            # unpadded) record by record.
            start, full = base + (first // k) * piece, (len(rows) - 1) // k
            out[start : start + full * piece].reshape(full, piece)[:, : k * rec] = rows[: full * k].reshape(full, k * rec)
            tail = rows[full * k :]
            out[start + full * piece : start + full * piece + tail.size] = tail.reshape(-1)

    def read(self, view: memoryview | bytes, count: int, dtype: np.dtype) -> np.ndarray:
        """`count` units of `dtype` from a view that starts at a piece boundary (not copied if unpadded)."""
        k = self.per_piece
        if k * self.unit_bytes == self.piece_bytes:
            return np.frombuffer(view, dtype=dtype, count=count)
        pieces = self.pieces(count)
        raw = np.frombuffer(view, dtype=np.uint8, count=(pieces - 1) * self.piece_bytes + (count - (pieces - 1) * k) * self.unit_bytes)
        whole = np.zeros(pieces * self.piece_bytes, dtype=np.uint8)
        whole[: raw.size] = raw
        body = whole.reshape(pieces, self.piece_bytes)[:, : k * self.unit_bytes]
        return np.ascontiguousarray(body).view(dtype).reshape(-1)[:count]


def lay_out_split(records: Records, units: Units, share: float, seed: int = 0,
                  into: Callable[[int], object] = bytearray) -> tuple[object, int, int]:
    """A holder's dataset as it travels: its training records in pieces, then its held-out records
    from a fresh piece, the rest zero. Returns (the buffer `into(size)` made, training records,
    held-out records); a holder lays it out straight into its private mapping."""
    train, held = held_out(len(records), share, seed)
    buffer = into(units.split_bytes(len(train), len(held)))
    out = np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]
    units.place(out, 0, records.array, train)
    units.place(out, units.eval_base(len(train)), records.array, held)
    return buffer, len(train), len(held)


def split_arrays(records: Records, share: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The same split as :func:`lay_out_split`, as arrays (the local loader, the G2 reference)."""
    train, held = held_out(len(records), share, seed)
    return records.array[train], records.array[held]


def as_tensors(batch: np.ndarray, convert: Callable[[np.ndarray], object]) -> dict[str, object]:
    """A batch of records as a mapping from field name to `convert`'s value (torch.from_numpy)."""
    return {name: convert(np.ascontiguousarray(batch[name])) for name in batch.dtype.names or ()}


def common_schema(holders: Sequence[tuple[str, str]]) -> RecordSchema:
    """The schema every holder's record dataset has; BadInput naming the first holder and field that differ."""
    schemas = []
    for name, path in holders:
        try:
            schemas.append((name, RecordSchema.from_json((Path(path) / SCHEMA_FILE).read_text())))
        except OSError:
            raise BadInput(f"holder {name!r}: {path} is not a record dataset (no {SCHEMA_FILE}); "
                           "write one with `gputravel data pack`") from None
    first_name, first = schemas[0]
    for name, schema in schemas[1:]:
        if why := first.difference(schema):
            raise BadInput(f"holder {name!r} holds records of another schema than holder {first_name!r}: {why}")
    return first
