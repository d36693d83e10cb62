"""The shipped record data of the `image` and `tabular` demos: scikit-learn's copies of two UCI data
sets (see demo_data/digits/README.md and demo_data/breast_cancer/README.md), dealt to holders.

Each holder's share goes through the real packers, as a holder's own files would: the digits as
PNGs in one folder per class, the breast-cancer cases as a CSV with named columns.
"""

from __future__ import annotations

import csv
import gzip
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image

from gputravel.data.pack import pack_images, pack_table
from gputravel.errors import BadInput

WORKLOADS = ("image", "tabular")
DIGIT_SHAPE = (1, 8, 8)
BREAST_CANCER_CLASSES = ("malignant", "benign")  # the target's 0 and 1
BREAST_CANCER_LABEL = "diagnosis"
BREAST_CANCER_FEATURES = tuple(
    f"{kind} {name}" if kind != "error" else f"{name} error"
    for kind in ("mean", "error", "worst")
    for name in ("radius", "texture", "perimeter", "area", "smoothness", "compactness", "concavity",
                 "concave points", "symmetry", "fractal dimension"))  # scikit-learn's load_breast_cancer names


def demo_holders(workload: str, count: int, workdir: Path | str) -> tuple[tuple[str, str], ...]:
    """(holder name, record dataset directory) for holders "holder-1".."holder-N": record i of the
    shipped data goes to holder i % count. The datasets are written under `workdir`/`workload`."""
    if workload not in WORKLOADS:
        raise BadInput(f"demo record data is for the workloads {', '.join(WORKLOADS)}, not {workload!r}")
    pixels, labels = _digits() if workload == "image" else _breast_cancer()
    if not 1 <= count <= len(labels):
        raise BadInput(f"demo holders: between 1 and {len(labels)} for the {workload} workload, got {count}")
    root = Path(workdir) / workload
    root.mkdir(parents=True, exist_ok=True)
    holders = []
    for h in range(count):
        name, share = f"holder-{h + 1}", np.arange(h, len(labels), count)
        raw = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.raw."))  # the holder's own files, then packed
        try:
            if workload == "image":
                _write_pngs(raw, pixels[share], labels[share], share)
                pack_images(raw, root / name, shape=DIGIT_SHAPE, classes=[str(d) for d in range(10)])
            else:
                _write_csv(raw / "cases.csv", pixels[share], labels[share])
                pack_table(raw / "cases.csv", root / name, label=BREAST_CANCER_LABEL, classes=BREAST_CANCER_CLASSES)
        finally:
            shutil.rmtree(raw, ignore_errors=True)
        holders.append((name, str(root / name)))
    return tuple(holders)


def _shipped(*parts: str) -> Path:
    path = Path(str(resources.files("gputravel").joinpath("demo_data", *parts)))
    if not path.is_file():
        raise BadInput(f"the demo data file {path} is missing from the installed package; reinstall gputravel")
    return path


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """(uint8[n,8,8] pixels 0..16, int64[n] digits) of digits.csv.gz: 64 pixels then the digit a row."""
    with gzip.open(_shipped("digits", "digits.csv.gz"), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return table[:, :64].reshape(-1, 8, 8).astype(np.uint8), table[:, 64]


def _breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    """(the 30 features as text, as shipped, [n,30]; int64[n] target) of breast_cancer.csv."""
    with open(_shipped("breast_cancer", "breast_cancer.csv"), newline="") as f:
        rows = list(csv.reader(f))[1:]  # the first row counts the cases and names the classes
    table = np.array(rows, dtype=object)
    return table[:, :30], table[:, 30].astype(np.int64)


def _write_pngs(folder: Path, pixels: np.ndarray, labels: np.ndarray, ids: np.ndarray) -> None:
    # 0..16 to 0..255, exactly (16 -> 255); a file per image, named by its index in the shipped data
    scaled = (pixels.astype(np.uint16) * 255 // 16).astype(np.uint8)
    for image, label, i in zip(scaled, labels, ids, strict=True):
        (folder / str(label)).mkdir(exist_ok=True)
        Image.fromarray(image).save(folder / str(label) / f"{i:04d}.png")


def _write_csv(path: Path, features: np.ndarray, labels: np.ndarray) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*BREAST_CANCER_FEATURES, BREAST_CANCER_LABEL])
        for row, label in zip(features, labels, strict=True):
            out.writerow([*row, BREAST_CANCER_CLASSES[label]])
