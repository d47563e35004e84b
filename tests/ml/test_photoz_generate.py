"""The photo-z example's survey generator: layout, determinism, and colours that carry redshift."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "photoz" / "generate.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("photoz_generate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def survey(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("survey")
    subprocess.run([sys.executable, str(SCRIPT), "--rows", "1e4", "--out", str(out), "--seed", "3"], check=True,
                   timeout=120)
    return out


def test_layout_many_files_and_a_success_marker(survey: Path) -> None:
    gen = _module()
    assert gen.survey_complete(survey, 10_000, 3) and not gen.survey_complete(survey, 10_000, 4)
    assert len(list((survey / "objects").glob("*.parquet"))) == gen.num_files(10_000) >= 8
    assert len(list((survey / "photometry").glob("*.parquet"))) == gen.num_files(10_000)
    objects = pads.dataset(survey / "objects").to_table()
    assert objects.column_names == ["id", "ra", "dec", "field", "z_true"]
    assert objects.num_rows == 10_000 and pc.count_distinct(objects["id"]).as_py() == 10_000
    phot = pads.dataset(survey / "photometry").to_table()
    assert phot.column_names == ["id", "band", "mag", "mag_err", "flags"]
    assert set(phot["band"].cast(pa.string()).to_pylist()) == set(gen.BANDS)
    assert 0.5 * 5 * 10_000 < phot.num_rows < 5 * 10_000  # some measurements are missing
    assert pc.any(pc.not_equal(phot["flags"], 0)).as_py()
    fields = pads.dataset(survey / "fields").to_table()
    assert fields.num_rows == gen.num_fields(10_000)
    assert set(objects["field"].to_pylist()) <= set(fields["field"].to_pylist())
    assert {f"ext_{b}" for b in gen.BANDS} <= set(fields.column_names)


def test_files_are_the_same_whoever_writes_them(survey: Path, tmp_path: Path) -> None:
    gen = _module()
    gen.write_survey(tmp_path, 10_000, seed=3, rank=1, size=3)  # files 1, 4, 7 as rank 1 of 3
    for part in (1, 4, 7):
        for kind in ("objects", "photometry"):
            name = f"part-{part:05d}.parquet"
            assert pads.dataset(tmp_path / kind / name).to_table().equals(
                pads.dataset(survey / kind / name).to_table())
    assert not (tmp_path / "objects" / "part-00000.parquet").exists()


def test_colours_carry_redshift(survey: Path) -> None:
    objects = pads.dataset(survey / "objects").to_table().to_pandas().set_index("id")
    phot = pads.dataset(survey / "photometry").to_table().to_pandas()
    phot = phot[phot["flags"] == 0]
    wide = phot.pivot(index="id", columns="band", values="mag").join(objects["z_true"]).dropna()
    x = np.stack([wide.u - wide.g, wide.g - wide.r, wide.r - wide.i, wide.i - wide.z, wide.r, np.ones(len(wide))], 1)
    z = wide.z_true.to_numpy()
    coef, *_ = np.linalg.lstsq(x, z, rcond=None)  # even a linear fit must beat the mean clearly
    assert np.std(z - x @ coef) < 0.6 * np.std(z)
