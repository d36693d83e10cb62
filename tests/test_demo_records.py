"""gputravel.data.demo_records: the shipped digits and breast-cancer tables, dealt to holders through the
packers, the same bytes every time."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import numpy as np
import pytest

from gputravel.data import demo_records
from gputravel.data.demo_records import BREAST_CANCER_FEATURES, demo_holders
from gputravel.data.pack import class_counts
from gputravel.data.records import load_records
from gputravel.errors import BadInput

# Pinned: a change to a demo schema (a field, a class name, a column name) changes what a job expects.
DIGESTS = {"image": "2ecb077a331af7f84a558482a19c9a7e83da7c738c0dd742f057a29e12f0aab9",
           "tabular": "17008a60ae94601ddd681344fcc81a4e46b4d7c96acb231b9699492d347cb0b8"}
SHIPPED = Path(demo_records.__file__).parents[1] / "demo_data"


def test_image_holders_get_every_third_digit_as_packed_pngs(tmp_path: Path) -> None:
    holders = demo_holders("image", 3, tmp_path)
    assert [name for name, _ in holders] == ["holder-1", "holder-2", "holder-3"]
    with gzip.open(SHIPPED / "digits" / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    assert table.shape == (1797, 65)
    for h, (_, directory) in enumerate(holders):
        records = load_records(directory)
        assert Path(directory) == tmp_path / "image" / f"holder-{h + 1}"
        assert records.schema.text() == "image: uint8[1,8,8]; label: int64[]"
        assert records.schema.digest() == DIGESTS["image"] and len(records) == 599
        share = table[h::3][np.argsort(table[h::3, 64], kind="stable")]  # packed in class, then file order
        assert records.array["label"].tolist() == share[:, 64].tolist()
        assert (records.array["image"].reshape(-1, 64).astype(np.int64) == share[:, :64] * 255 // 16).all()
    assert sorted(p.name for p in (tmp_path / "image").iterdir()) == ["holder-1", "holder-2", "holder-3"]


def test_tabular_holders_get_named_columns_and_the_two_diagnoses(tmp_path: Path) -> None:
    holders = demo_holders("tabular", 3, tmp_path)
    with open(SHIPPED / "breast_cancer" / "breast_cancer.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:4] == ["569", "30", "malignant", "benign"] and len(rows) == 570
    every = [load_records(d) for _, d in holders]
    assert [len(r) for r in every] == [190, 190, 189]
    for h, records in enumerate(every):
        assert records.schema.digest() == DIGESTS["tabular"]
        assert records.schema.field("features").names == BREAST_CANCER_FEATURES
        assert records.schema.field("label").names == ("malignant", "benign")
        mine = rows[1 + h :: 3]
        assert records.array["features"].tolist() == np.array([r[:30] for r in mine], dtype=np.float32).tolist()
        assert records.array["label"].tolist() == [int(r[30]) for r in mine]  # 0 malignant, 1 benign
    totals = [sum(class_counts(r)["label"][c] for r in every) for c in ("malignant", "benign")]
    assert totals == [212, 357]
    assert BREAST_CANCER_FEATURES[:2] == ("mean radius", "mean texture")
    assert BREAST_CANCER_FEATURES[10] == "radius error" and BREAST_CANCER_FEATURES[-1] == "worst fractal dimension"


@pytest.mark.parametrize("workload", ["image", "tabular"])
def test_the_demo_records_are_the_same_bytes_every_time(tmp_path: Path, workload: str) -> None:
    first = [(Path(d) / "records.npy").read_bytes() for _, d in demo_holders(workload, 2, tmp_path)]
    again = [(Path(d) / "records.npy").read_bytes() for _, d in demo_holders(workload, 2, tmp_path)]  # over the first
    assert first == again and first[0] != first[1]
    assert sorted(p.name for p in (tmp_path / workload).iterdir()) == ["holder-1", "holder-2"]  # no raw files left


@pytest.mark.parametrize(("workload", "count", "message"), [
    ("gpt2", 3, r"for the workloads image, tabular, not 'gpt2'"),
    ("image", 0, r"between 1 and 1797 for the image workload, got 0"),
    ("tabular", 570, r"between 1 and 569 for the tabular workload, got 570"),
])
def test_a_bad_workload_or_holder_count_is_refused(tmp_path: Path, workload: str, count: int, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        demo_holders(workload, count, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dataset", ["digits", "breast_cancer"])
def test_the_shipped_data_names_its_source_citation_and_licence(dataset: str) -> None:
    readme = (SHIPPED / dataset / "README.md").read_text()
    assert "UCI Machine Learning Repository" in readme and "https://doi.org/10.24432/" in readme
    assert "CC BY 4.0" in readme and "scikit-learn" in readme
    assert sum(p.stat().st_size for p in (SHIPPED / dataset).iterdir()) < 150_000
