"""`gputravel data pack`: a holder's own files into a record dataset (data/records.py), run where
the data lives. Images in one folder per class (Pillow), or a table (CSV; Parquet through
pyarrow); text into tokens stays `gputravel data prepare` (data/prepare.py).

Bad input is named by its file and its row, column or image, never by its content (it is the
holder's data). Nothing is written half: write_records replaces `out` whole or not at all.
"""

from __future__ import annotations

import csv
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from gputravel.data.records import Field, Records, RecordSchema, write_records
from gputravel.errors import BadInput
from gputravel.files import MISSING, not_data

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
IMAGE_FORMATS = ["PNG", "JPEG"]  # Pillow's names; a file of another format is refused, whatever its name
MODES = {1: "L", 3: "RGB"}  # channels -> Pillow mode
RESAMPLE = Image.Resampling.BILINEAR  # one fixed filter: the same files give the same records
MAX_SHOWN = 12  # header names listed in a message
FLOAT32_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- images
def pack_images(folder: Path | str, out: Path | str, *, shape: Sequence[int],
                classes: Sequence[str] | None = None) -> Records:
    """Pack `folder`/CLASS/*.png|jpg into `out`: ``image: uint8[C,H,W]; label: int64[]``, the
    label's names the classes (sorted folder names unless `classes` is given). Records are in
    class order, then file name order."""
    folder = Path(folder)
    channels, height, width = _image_shape(shape)
    names, files = _class_files(folder, classes)
    schema = RecordSchema((Field("image", "uint8", (channels, height, width)),
                           Field("label", "int64", (), tuple(names))))
    array = np.zeros(len(files), dtype=schema.dtype)
    for i, (label, path) in enumerate(files):
        array["image"][i] = read_image(path, channels, height, width)
        array["label"][i] = label
    write_records(out, schema, array)
    return Records(schema, array)


def _image_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    if len(shape) != 3 or any(type(n) is not int or n <= 0 for n in shape) or shape[0] not in MODES:
        raise BadInput(f"an image shape is C,H,W with C 1 (grayscale) or 3 (RGB), e.g. 1,28,28; got {list(shape)}")
    return shape[0], shape[1], shape[2]


def _class_files(folder: Path, classes: Sequence[str] | None) -> tuple[list[str], list[tuple[int, Path]]]:
    """The class names and (label, file) of every image, in record order."""
    _must_be(folder, "image folder", directory=True)
    loose = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if loose:
        raise BadInput(f"{folder / loose[0]} is in no class folder: put each image in its class's folder")
    found = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if classes is None:
        if not found:
            raise BadInput(f"no class folders in {folder}: put each class's images in a folder named after it")
        names = found
    else:
        names = _declared(classes)
        stray = [n for n in found if n not in names]
        if stray:
            raise BadInput(f"{folder / stray[0]} is not one of the declared classes ({_listed(names)})")
    # A declared class may have no folder (this holder has none of it); a folder is never empty.
    files = [(label, path) for label, name in enumerate(names) if name in found
             for path in _images_in(folder / name)]
    return names, files


def _images_in(directory: Path) -> list[Path]:
    files = []
    for path in sorted(directory.iterdir(), key=lambda p: p.name):
        if path.name.startswith("."):
            continue
        if path.is_dir():
            raise BadInput(f"{path} is a folder inside a class folder: put a class's images directly in it")
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise BadInput(f"{path} is not a PNG or JPEG file by its name; convert it or move it out of {directory}")
        files.append(path)
    if not files:
        raise BadInput(f"class folder {directory} holds no images: add PNG or JPEG files, or remove the folder")
    return files


def read_image(path: Path, channels: int, height: int, width: int) -> np.ndarray:
    """The image at `path` as uint8[C,H,W]: turned upright (EXIF), converted and resized."""
    _must_be(path, "image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path, formats=IMAGE_FORMATS) as im:
                if im.mode.startswith(("I", "F")):
                    raise BadInput(f"{path}: a {im.mode} (16-bit or float) image; convert it to 8-bit first")
                upright = ImageOps.exif_transpose(im)
                image = upright.convert(MODES[channels]).resize((width, height), RESAMPLE)
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadInput(f"{path} is not a readable PNG or JPEG image (or is too large)") from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data; Pillow raises all three
        raise BadInput(f"{path} is a damaged image ({type(exc).__name__}): re-export it or leave it out") from None
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)


# ----------------------------------------------------------------------------- tables
def pack_table(path: Path | str, out: Path | str, *, label: str, features: Sequence[str] | None = None,
               classes: Sequence[str] | None = None) -> Records:
    """Pack a table (CSV with a header; .parquet through pyarrow) into `out`:
    ``features: float32[n]`` (names: the feature columns) and ``label: int64[]`` (names: the
    classes; by default the distinct labels, sorted as numbers when all are integers)."""
    path = Path(path)
    _must_be(path, "table")
    header, rows = _parquet_rows(path) if path.suffix.lower() == ".parquet" else _csv_rows(path)
    columns = _columns(path, header, label, features)
    values: list[np.ndarray] = []
    labels: list[tuple[int, str]] = []
    at = header.index(label)
    for row, cells in rows:
        if len(cells) != len(header):
            raise BadInput(f"{path}, row {row}: {len(cells)} cells, the header has {len(header)}")
        values.append(_feature_row(path, row, [(header[c], cells[c]) for c in columns]))
        labels.append((row, _label_cell(path, row, label, cells[at])))
    if not values:
        raise BadInput(f"{path} is an empty table: no rows below its header")
    names = _declared(classes) if classes is not None else _sorted_classes(v for _, v in labels)
    schema = RecordSchema((Field("features", "float32", (len(columns),), tuple(header[c] for c in columns)),
                           Field("label", "int64", (), tuple(names))))
    array = np.zeros(len(values), dtype=schema.dtype)
    array["features"] = np.stack(values)
    array["label"] = _label_indices(path, label, labels, names)
    write_records(out, schema, array)
    return Records(schema, array)


def _csv_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, list[str]]]]:
    """The header and an iterator of (row as a spreadsheet numbers it, cells); the header is row 1."""
    handle = open(path, newline="", encoding="utf-8-sig")  # -sig: a spreadsheet's byte-order mark is no column name
    reader = csv.reader(handle)
    with _csv_errors(path, reader):
        header = next(reader, None)
    if not header:
        handle.close()
        raise BadInput(f"{path} is an empty table: no header row")

    def rows() -> Iterator[tuple[int, list[str]]]:
        with handle, _csv_errors(path, reader):
            for cells in reader:
                if cells:  # a blank line is no row
                    yield reader.line_num, cells
    return [h.strip() for h in header], rows()


@contextmanager
def _csv_errors(path: Path, reader: Any) -> Iterator[None]:
    try:
        yield
    except UnicodeDecodeError:  # decoded a buffer ahead of the rows: no row to name
        raise BadInput(f"{path} is not UTF-8 text: save the table as UTF-8 CSV") from None
    except csv.Error as exc:
        raise BadInput(f"{path}, row {reader.line_num}: not CSV ({exc}); check its quotes") from None


def _parquet_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, list[object]]]]:
    """As _csv_rows, for a Parquet file (no header row: the first record is row 1)."""
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found, unused-ignore]  # optional, not a dependency
    except ImportError:
        raise BadInput(f"{path}: reading Parquet needs pyarrow (pip install pyarrow); "
                       "or convert the table to CSV with a header row") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path} is not a readable Parquet file ({type(exc).__name__})") from None
    header = [str(n) for n in table.column_names]
    data = table.to_pydict()
    columns = [data[n] for n in table.column_names]
    return header, ((i + 1, [c[i] for c in columns]) for i in range(table.num_rows))


def _columns(path: Path, header: list[str], label: str, features: Sequence[str] | None) -> list[int]:
    """The feature columns' indices, in the order asked (header order by default)."""
    if "" in header:
        raise BadInput(f"{path}: column {header.index('') + 1} of the header has no name")
    if len(set(header)) != len(header):
        twice = next(h for h in header if header.count(h) > 1)
        raise BadInput(f"{path}: column {twice!r} appears twice in the header")
    wanted = [label, *(features or ())]
    missing = next((c for c in wanted if c not in header), None)
    if missing is not None:
        raise BadInput(f"{path}: no column {missing!r}; the header has {_listed(header)}")
    chosen = [h for h in header if h != label] if features is None else list(features)
    if label in chosen or len(set(chosen)) != len(chosen) or not chosen:
        raise BadInput(f"{path}: the features are one or more columns, each once, other than the label {label!r}")
    return [header.index(c) for c in chosen]


def _feature_row(path: Path, row: int, cells: list[tuple[str, object]]) -> np.ndarray:
    values = np.zeros(len(cells), dtype=np.float32)
    for i, (column, cell) in enumerate(cells):
        where = f"{path}, row {row}, column {column!r}"
        if cell is None or (isinstance(cell, str) and not cell.strip()):
            raise BadInput(f"{where}: a missing value; fill it in or leave the row out")
        try:
            number = float(cell)  # type: ignore[arg-type]  # a str, or a Parquet cell's number
        except (TypeError, ValueError):
            raise BadInput(f"{where}: not a number") from None
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            raise BadInput(f"{where}: NaN or infinite (or too large for float32)")
        values[i] = number
    return values


def _label_cell(path: Path, row: int, label: str, cell: object) -> str:
    text = "" if cell is None else str(cell).strip()
    if not text:
        raise BadInput(f"{path}, row {row}, column {label!r}: a missing label")
    return text


def _label_indices(path: Path, column: str, labels: list[tuple[int, str]], names: list[str]) -> np.ndarray:
    index = {n: i for i, n in enumerate(names)}
    for row, value in labels:
        if value not in index:  # named by its place, never its text: a cell is the holder's data
            raise BadInput(f"{path}, row {row}, column {column!r}: a label that is not one of the declared "
                           f"classes ({_listed(names)})")
    return np.array([index[v] for _, v in labels], dtype=np.int64)


def _sorted_classes(values: Iterable[str]) -> list[str]:
    # 0, 1, ..., 10 as numbers: "10" sorted as text would come before "2".
    distinct = set(values)
    try:
        return sorted(distinct, key=int)
    except ValueError:
        return sorted(distinct)


# ----------------------------------------------------------------------------- shared
def _declared(classes: Sequence[str]) -> list[str]:
    names = [c.strip() for c in classes]
    if not names or "" in names or len(set(names)) != len(names):
        raise BadInput(f"--classes names each class once, none empty; got {_listed(list(classes))}")
    return names


def _must_be(path: Path, what: str, *, directory: bool = False) -> None:
    why = not_data(path)  # a FIFO or a device is refused before anything reads it
    if why is None and path.is_dir() != directory:
        why = "is a folder" if path.is_dir() else "is a file, not a folder"
    if why is not None:
        raise BadInput(f"{what} {path} {why + '; check the path' if why == MISSING else why}")


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:MAX_SHOWN])
    return f"{shown}, ... {len(names)} in all" if len(names) > MAX_SHOWN else shown or "none"


def class_counts(records: Records) -> dict[str, dict[str, int]]:
    """{field: {class: records}} for every scalar integer field that names its classes (a label)."""
    counts = {}
    for f in records.schema.fields:
        if f.names and not f.shape and np.dtype(f.dtype).kind in "iu":
            values = np.asarray(records.array[f.name], dtype=np.int64)
            per = {name: int(np.count_nonzero(values == i)) for i, name in enumerate(f.names)}
            outside = len(values) - sum(per.values())
            counts[f.name] = per | ({"(outside the classes)": outside} if outside else {})
    return counts
