"""gputravel.data.pack and `gputravel data pack|show`: images and tables into record datasets, each bad
input named by its file and its row, column or image, and nothing written half."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from gputravel.cli.data import data_app
from gputravel.data.pack import class_counts, pack_images, pack_table
from gputravel.data.records import load_records
from gputravel.data.shards import list_shards
from gputravel.errors import BadInput


def image(path: Path, value: int | tuple[int, ...], size: tuple[int, int] = (6, 4), mode: str = "L") -> Path:
    """A solid image of `value`, `size` (width, height), saved as its suffix says."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value).save(path)
    return path


@pytest.fixture
def pets(tmp_path: Path) -> Path:
    """cat/ (two PNGs, one RGB) and dog/ (a JPEG): folder names sorted are the classes."""
    root = tmp_path / "pets"
    image(root / "cat" / "b.png", 200)
    image(root / "cat" / "a.png", (10, 10, 10), mode="RGB")
    image(root / "dog" / "z.jpg", (100, 100, 100), mode="RGB")
    return root


def written(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# ----------------------------------------------------------------------------- images
def test_images_are_packed_in_class_then_file_order_resized_and_converted(pets: Path, tmp_path: Path) -> None:
    records = pack_images(pets, tmp_path / "out", shape=(1, 3, 5))
    assert records.schema.text() == "image: uint8[1,3,5]; label: int64[]"
    assert records.schema.field("label").names == ("cat", "dog")
    assert records.array["label"].tolist() == [0, 0, 1]  # cat/a.png, cat/b.png, dog/z.jpg
    images = records.array["image"]
    assert images.shape == (3, 1, 3, 5) and images.dtype == np.uint8
    assert (images[0] == 10).all() and (images[1] == 200).all()
    assert abs(int(images[2].mean()) - 100) <= 2  # a JPEG is lossy
    again = load_records(tmp_path / "out")
    assert again.schema == records.schema and again.array.tobytes() == records.array.tobytes()


def test_rgb_images_keep_their_channels_first(tmp_path: Path) -> None:
    image(tmp_path / "in" / "red" / "r.png", (255, 0, 0), size=(9, 7), mode="RGB")
    image(tmp_path / "in" / "grey" / "g.png", 128, size=(2, 2))
    records = pack_images(tmp_path / "in", tmp_path / "out", shape=(3, 4, 4))
    grey, red = records.array["image"]  # "grey" sorts before "red"
    assert red.shape == (3, 4, 4) and (red[0] == 255).all() and (red[1:] == 0).all()
    assert (grey == 128).all()


def test_declared_classes_set_the_label_order_and_may_have_no_folder(pets: Path, tmp_path: Path) -> None:
    records = pack_images(pets, tmp_path / "out", shape=(1, 2, 2), classes=["dog", "bird", "cat"])
    assert records.schema.field("label").names == ("dog", "bird", "cat")
    assert records.array["label"].tolist() == [0, 2, 2]
    assert class_counts(records) == {"label": {"dog": 1, "bird": 0, "cat": 2}}


def test_packing_twice_gives_the_same_bytes(pets: Path, tmp_path: Path) -> None:
    pack_images(pets, tmp_path / "one", shape=(3, 5, 5))
    pack_images(pets, tmp_path / "two", shape=(3, 5, 5))
    assert snapshot(tmp_path / "one") == snapshot(tmp_path / "two")


def corrupt(root: Path) -> str:
    (root / "cat" / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    return r"cat/c\.png"


def truncated(root: Path) -> str:
    whole = image(root / "dog" / "t.png", 7, size=(64, 64)).read_bytes()
    (root / "dog" / "t.png").write_bytes(whole[: len(whole) // 2])
    return r"dog/t\.png"


def gif_named_png(root: Path) -> str:
    Image.new("L", (4, 4), 3).save(root / "dog" / "g.png", format="GIF")
    return r"dog/g\.png"


def sixteen_bit(root: Path) -> str:
    Image.new("I;16", (4, 4), 40000).save(root / "dog" / "deep.png")
    return r"dog/deep\.png.*8-bit"


def empty_class(root: Path) -> str:
    (root / "fish").mkdir()
    return r"class folder .*fish holds no images"


def not_an_image(root: Path) -> str:
    (root / "cat" / "notes.txt").write_text("x")
    return r"cat/notes\.txt is not a PNG or JPEG"


def nested(root: Path) -> str:
    (root / "cat" / "more").mkdir()
    return r"cat/more is a folder inside a class folder"


def loose(root: Path) -> str:
    image(root / "stray.png", 1)
    return r"stray\.png is in no class folder"


@pytest.mark.parametrize("spoil", [corrupt, truncated, gif_named_png, sixteen_bit, empty_class, not_an_image,
                                   nested, loose])
def test_a_bad_image_folder_is_named_and_nothing_is_written(pets: Path, tmp_path: Path, spoil) -> None:
    good = pack_images(pets, tmp_path / "out", shape=(1, 2, 2))
    before = snapshot(tmp_path / "out")
    pattern = spoil(pets)
    with pytest.raises(BadInput, match=pattern) as caught:
        pack_images(pets, tmp_path / "out", shape=(1, 2, 2))
    assert "\n" not in str(caught.value)
    assert snapshot(tmp_path / "out") == before and len(good) == 3  # the earlier pack survives unchanged
    with pytest.raises(BadInput, match=pattern):
        pack_images(pets, tmp_path / "fresh", shape=(1, 2, 2))
    assert written(tmp_path) == ["out", "pets"]  # no output, no temporary left


def test_no_class_folders_a_missing_folder_and_undeclared_classes_are_refused(pets: Path, tmp_path: Path) -> None:
    (tmp_path / "flat").mkdir()
    with pytest.raises(BadInput, match=r"no class folders in .*flat"):
        pack_images(tmp_path / "flat", tmp_path / "out", shape=(1, 2, 2))
    with pytest.raises(BadInput, match=r"image folder .*nope does not exist"):
        pack_images(tmp_path / "nope", tmp_path / "out", shape=(1, 2, 2))
    with pytest.raises(BadInput, match=r"dog is not one of the declared classes \('cat'\)"):
        pack_images(pets, tmp_path / "out", shape=(1, 2, 2), classes=["cat"])
    with pytest.raises(BadInput, match=r"--classes names each class once"):
        pack_images(pets, tmp_path / "out", shape=(1, 2, 2), classes=["cat", "dog", "cat"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape", [(2, 4, 4), (1, 4), (1, 0, 4), (3, 4, 4, 1)])
def test_an_image_shape_is_one_or_three_channels_and_two_sizes(pets: Path, tmp_path: Path, shape) -> None:
    with pytest.raises(BadInput, match=r"an image shape is C,H,W"):
        pack_images(pets, tmp_path / "out", shape=shape)


def test_out_that_is_not_a_record_dataset_is_left_alone(pets: Path, tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("someone's")
    with pytest.raises(BadInput, match=r"mine exists and is not a record dataset"):
        pack_images(pets, tmp_path / "mine", shape=(1, 2, 2))
    assert written(tmp_path / "mine") == ["keep.txt"] and written(tmp_path) == ["mine", "pets"]


# ----------------------------------------------------------------------------- tables
def csv_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


TABLE = "age,weight,outcome\n30,70.5,sick\n41,80,well\n\n52,90.25,sick\n"


def test_a_table_is_packed_with_named_features_and_sorted_classes(tmp_path: Path) -> None:
    records = pack_table(csv_file(tmp_path / "t.csv", TABLE), tmp_path / "out", label="outcome")
    assert records.schema.text() == "features: float32[2]; label: int64[]"
    assert records.schema.field("features").names == ("age", "weight")
    assert records.schema.field("label").names == ("sick", "well")
    assert records.array["features"].tolist() == [[30, 70.5], [41, 80], [52, 90.25]]
    assert records.array["label"].tolist() == [0, 1, 0]
    assert load_records(tmp_path / "out").array.tobytes() == records.array.tobytes()


def test_features_and_classes_may_be_chosen(tmp_path: Path) -> None:
    path = csv_file(tmp_path / "t.csv", "\ufeffa,b,c,y\n1,2,3,no\n4,5,6,yes\n")  # with a spreadsheet's BOM
    records = pack_table(path, tmp_path / "out", label="y", features=["c", "a"], classes=["yes", "no", "maybe"])
    assert records.schema.field("features").names == ("c", "a")
    assert records.array["features"].tolist() == [[3, 1], [6, 4]]
    assert records.array["label"].tolist() == [1, 0]
    assert records.schema.field("label").names == ("yes", "no", "maybe")


def test_integer_labels_sort_as_numbers(tmp_path: Path) -> None:
    path = csv_file(tmp_path / "t.csv", "x,y\n1,10\n2,2\n3,1\n")
    records = pack_table(path, tmp_path / "out", label="y")
    assert records.schema.field("label").names == ("1", "2", "10")
    assert records.array["label"].tolist() == [2, 1, 0]


@pytest.mark.parametrize(("text", "options", "message"), [
    ("a,b\n1,2\n", {"label": "y"}, r"t\.csv: no column 'y'; the header has 'a', 'b'"),
    ("a,y\n1,2\n", {"label": "y", "features": ["a", "z"]}, r"t\.csv: no column 'z'; the header has 'a', 'y'"),
    ("a,y\n1,x\n2,y\nsecret,x\n", {"label": "y"}, r"t\.csv, row 4, column 'a': not a number$"),
    ("a,y\n1,x\nnan,x\n", {"label": "y"}, r"t\.csv, row 3, column 'a': NaN or infinite"),
    ("a,y\n-inf,x\n", {"label": "y"}, r"t\.csv, row 2, column 'a': NaN or infinite"),
    ("a,y\n1e39,x\n", {"label": "y"}, r"t\.csv, row 2, column 'a': NaN or infinite \(or too large for float32\)"),
    ("a,b,y\n1,,x\n", {"label": "y"}, r"t\.csv, row 2, column 'b': a missing value"),
    ("a,y\n1, \n", {"label": "y"}, r"t\.csv, row 2, column 'y': a missing label"),
    ("a,y\n1,x\n2,z\n", {"label": "y", "classes": ["x"]},
     r"t\.csv, row 3, column 'y': a label that is not one of the declared classes \('x'\)$"),
    ("a,y\n1,x\n2,aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n", {"label": "y", "classes": ["x"]},
     r"row 3, column 'y': a label that is not one of the declared classes \('x'\)$"),
    ("a,y\n1,x\n2,x,3\n", {"label": "y"}, r"t\.csv, row 3: 3 cells, the header has 2"),
    ("a,y\n", {"label": "y"}, r"t\.csv is an empty table: no rows below its header"),
    ("", {"label": "y"}, r"t\.csv is an empty table: no header row"),
    ("a,a,y\n1,2,x\n", {"label": "y"}, r"t\.csv: column 'a' appears twice"),
    ("a,,y\n1,2,x\n", {"label": "y"}, r"t\.csv: column 2 of the header has no name"),
    ("a,y\n1,x\n", {"label": "y", "features": ["y"]}, r"other than the label 'y'"),
])
def test_a_bad_table_is_named_by_file_row_and_column(tmp_path: Path, text: str, options: dict, message: str) -> None:
    path = csv_file(tmp_path / "t.csv", text)
    pack_table(csv_file(tmp_path / "good.csv", "a,y\n5,x\n"), tmp_path / "out", label="y")
    before = snapshot(tmp_path / "out")
    with pytest.raises(BadInput, match=message) as caught:
        pack_table(path, tmp_path / "out", **options)
    assert "\n" not in str(caught.value) and "secret" not in str(caught.value)  # a cell's text is not echoed
    assert snapshot(tmp_path / "out") == before
    with pytest.raises(BadInput):
        pack_table(path, tmp_path / "fresh", **options)
    assert written(tmp_path) == ["good.csv", "out", "t.csv"]


def test_a_row_number_counts_as_a_spreadsheet_does_with_a_quoted_line_break(tmp_path: Path) -> None:
    path = csv_file(tmp_path / "t.csv", 'note,a,y\n"two\nlines",1,x\nok,bad,x\n')
    with pytest.raises(BadInput, match=r"row 4, column 'a'"):  # the file's line 4; the record is the 3rd row
        pack_table(path, tmp_path / "out", label="y", features=["a"])


def test_a_table_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_bytes(b"a,y\n1,x\n\xff\xfe,x\n")
    with pytest.raises(BadInput, match=r"t\.csv is not UTF-8 text"):
        pack_table(tmp_path / "t.csv", tmp_path / "out", label="y")
    (tmp_path / "long.csv").write_text("a,y\n1,x\n2," + "x" * 200_000 + "\n")
    with pytest.raises(BadInput, match=r"long\.csv, row 3: not CSV \(field larger than field limit"):
        pack_table(tmp_path / "long.csv", tmp_path / "out", label="y")
    with pytest.raises(BadInput, match=r"table .*missing\.csv does not exist"):
        pack_table(tmp_path / "missing.csv", tmp_path / "out", label="y")


def test_parquet_without_pyarrow_says_to_install_it_or_convert(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as when pyarrow is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(BadInput, match=r"t\.parquet: reading Parquet needs pyarrow .* convert the table to CSV"):
        pack_table(tmp_path / "t.parquet", tmp_path / "out", label="y")


def test_parquet_goes_through_the_same_checks(tmp_path: Path, monkeypatch) -> None:
    columns = {"a": [1.5, 2.0, None], "y": [0, 1, 1]}

    class Table:
        column_names = list(columns)
        num_rows = 3

        @staticmethod
        def to_pydict() -> dict:
            return columns

    parquet = types.SimpleNamespace(read_table=lambda path: Table)
    monkeypatch.setitem(sys.modules, "pyarrow", types.SimpleNamespace(parquet=parquet))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(BadInput, match=r"t\.parquet, row 3, column 'a': a missing value"):
        pack_table(tmp_path / "t.parquet", tmp_path / "out", label="y")
    columns["a"][2] = 3
    records = pack_table(tmp_path / "t.parquet", tmp_path / "out", label="y")
    assert records.array["features"].tolist() == [[1.5], [2.0], [3.0]]
    assert records.schema.field("label").names == ("0", "1") and records.array["label"].tolist() == [0, 1, 1]


# ----------------------------------------------------------------------------- CLI
def cli(*args: str):
    return CliRunner().invoke(data_app, list(args))


def test_cli_pack_images_and_show(pets: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli("pack", "images", str(pets), "--out", str(out), "--shape", "1,8,8", "--classes", "dog,cat")
    assert result.exit_code == 0, result.output
    digest = load_records(out).schema.digest()
    assert "packed 3 records" in result.output and digest in result.output
    shown = cli("show", str(out))
    assert shown.exit_code == 0, shown.output
    assert "image: uint8[1,8,8]; label: int64[]" in shown.output and digest in shown.output
    assert re.search(r"records\s+3\b", shown.output) and "label: dog 1, cat 2" in shown.output


def test_cli_pack_table_with_features_and_classes(tmp_path: Path) -> None:
    path = csv_file(tmp_path / "t.csv", TABLE)
    result = cli("pack", "table", str(path), "--out", str(tmp_path / "out"), "--label", "outcome",
                 "--features", "weight", "--classes", "well,sick")
    assert result.exit_code == 0, result.output
    assert "features: float32[1]; label: int64[]" in result.output and "label: well 1, sick 2" in result.output


def test_cli_pack_text_is_prepare(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text")
    result = cli("pack", "text", "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "shards"),
                 "--tokenizer", "bytes")
    assert result.exit_code == 0, result.output
    assert "prepared 1 files" in result.output and len(list_shards(tmp_path / "shards")) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["pack", "images", "{pets}", "--out", "{out}", "--shape", "1,x,8"], r"--shape is sizes separated by commas"),
    (["pack", "images", "{pets}", "--out", "{out}", "--shape", "2,8,8"], r"an image shape is C,H,W"),
    (["pack", "images", "{tmp}/none", "--out", "{out}", "--shape", "1,8,8"], r"none does not exist"),
    (["pack", "table", "{tmp}/t.csv", "--out", "{out}", "--label", "nope"], r"t\.csv: no column 'nope'"),
    (["show", "{tmp}"], r"is not a record dataset"),
])
def test_cli_bad_input_is_one_line_and_exit_1(pets: Path, tmp_path: Path, args: list[str], message: str) -> None:
    csv_file(tmp_path / "t.csv", TABLE)
    result = cli(*(a.format(pets=pets, out=tmp_path / "out", tmp=tmp_path) for a in args))
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error:") and result.output.count("\n") == 1
    assert re.search(message, result.output), result.output
    assert not (tmp_path / "out").exists()
