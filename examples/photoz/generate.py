"""Synthetic galaxy survey for the photometric-redshift example.

Writes three Parquet tables, split over many files so they can be read in
parallel::

    OUT/objects/part-00000.parquet ...   id, ra, dec, field, z_true
    OUT/photometry/part-00000.parquet    id, band, mag, mag_err, flags   (long format, one row per detection)
    OUT/fields/fields.parquet            field, ra0, dec0, seeing, ebv, ext_u ... ext_z
    OUT/_SUCCESS                         JSON of the arguments, written last

Magnitudes come from a redshift-dependent spectral model: every galaxy has a
type between an old red population (strong 4000 Å break, steep continuum)
and a young blue one; the break moves through u, g, r, i, z as the redshift
grows, so colours predict redshift.  Observed magnitudes add Galactic
extinction of the galaxy's field, noise that grows towards each band's depth
and with the field's seeing, non-detections (no row), and flagged bad
measurements (saturated, blended, bad pixels).  Each file depends only on
(seed, file number), so any subset of files can be written by any process —
under ``mpiexec`` rank r writes files r, r+size, ...

    python examples/photoz/generate.py --rows 100000 --out data/photoz
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BANDS = ("u", "g", "r", "i", "z")
WAVELENGTH = np.array([3560.0, 4830.0, 6260.0, 7670.0, 9100.0])  # effective wavelength, Å
DEPTH = np.array([24.6, 25.6, 25.3, 24.8, 24.2])  # 5-sigma limiting magnitude
EXTINCTION_R = np.array([4.24, 3.30, 2.29, 1.70, 1.26])  # A_band / E(B-V)
FLAG_SATURATED, FLAG_BLENDED, FLAG_BAD_PIXEL = 1, 2, 4
BAD_FLAGS = FLAG_SATURATED | FLAG_BAD_PIXEL
ROWS_PER_FILE = 200_000
FIELD_SIZE_DEG = 1.0
MIN_ROWS, MAX_ROWS = 1_000, 1_000_000_000


def num_fields(rows: int) -> int:
    return int(min(20_000, max(16, rows // 2_000)))


def fields_table(rows: int, seed: int) -> pa.Table:
    """One row per survey field: position, seeing, E(B-V) and the extinction per band."""
    n = num_fields(rows)
    rng = np.random.default_rng([seed, 0xF1E1D])
    per_row = int(math.ceil(math.sqrt(n)))
    idx = np.arange(n)
    ebv = rng.lognormal(math.log(0.03), 0.6, n).clip(0.002, 0.3)
    columns = {
        "field": idx.astype(np.int32),
        "ra0": (idx % per_row) * FIELD_SIZE_DEG + 10.0,
        "dec0": (idx // per_row) * FIELD_SIZE_DEG - 30.0,
        "seeing": rng.lognormal(math.log(0.8), 0.2, n).clip(0.45, 2.0),
        "ebv": ebv,
    }
    for band, r in zip(BANDS, EXTINCTION_R):
        columns[f"ext_{band}"] = r * ebv
    return pa.table(columns)


def _luminosity_distance_modulus(z: np.ndarray) -> np.ndarray:
    """Distance modulus in flat ΛCDM (H0 = 70, Ωm = 0.3), from a tabulated integral."""
    grid = np.linspace(0.0, 4.0, 4001)
    inv_e = 1.0 / np.sqrt(0.3 * (1 + grid) ** 3 + 0.7)
    comoving = np.concatenate([[0.0], np.cumsum((inv_e[1:] + inv_e[:-1]) / 2 * np.diff(grid))])
    dc = np.interp(z, grid, comoving) * 299792.458 / 70.0  # Mpc
    return 5.0 * np.log10(np.maximum((1 + z) * dc, 1e-6) * 1e5)


def _rest_frame_colour(rest_wavelength: np.ndarray, galaxy_type: np.ndarray) -> np.ndarray:
    """-2.5 log10 of the SED relative to 5000 Å rest frame: continuum slope plus a 4000 Å break."""
    t = galaxy_type[:, None]
    slope = 2.2 - 1.8 * t  # red galaxies rise steeply to the red
    break_depth = 1.6 * (1.0 - t) + 0.25  # magnitudes fainter below 4000 Å
    below = 1.0 / (1.0 + np.exp((rest_wavelength - 4000.0) / 120.0))
    uv_rise = 0.6 * t * np.clip((3000.0 - rest_wavelength) / 1000.0, 0, None)  # blue galaxies: UV upturn
    return -slope * np.log10(rest_wavelength / 5000.0) * 2.5 + break_depth * below - uv_rise


def objects_and_photometry(part: int, rows: int, seed: int, fields: pa.Table) -> tuple[pa.Table, pa.Table]:
    """The objects of file ``part`` and their long-format photometry."""
    per_file = rows_per_file(rows)
    start = part * per_file
    n = max(0, min(per_file, rows - start))
    rng = np.random.default_rng([seed, part])
    ids = np.arange(start, start + n, dtype=np.int64)
    # redshift: p(z) ∝ z² exp(-(z/z0)^1.5), z0 = 0.55 — a deep optical survey
    z = np.clip(rng.gamma(3.0, 0.23, n), 0.02, 3.0)
    galaxy_type = rng.beta(1.4, 1.4, n)
    n_fields = fields.num_rows
    field = rng.integers(0, n_fields, n, dtype=np.int32)
    ra = fields.column("ra0").to_numpy()[field] + rng.uniform(0, FIELD_SIZE_DEG, n)
    dec = fields.column("dec0").to_numpy()[field] + rng.uniform(0, FIELD_SIZE_DEG, n)
    objects = pa.table({"id": ids, "ra": ra, "dec": dec, "field": field, "z_true": z})

    absolute = rng.normal(-21.0 + 0.4 * galaxy_type, 0.9, n)  # rest-frame 5000 Å absolute magnitude
    reference = _luminosity_distance_modulus(z) + absolute
    reference = np.where(reference < 17.0, 17.0 + rng.uniform(0, 1, n), reference)
    reference = np.where(reference > 24.8, 24.8 - rng.exponential(0.8, n), reference)  # magnitude-limited
    rest = WAVELENGTH[None, :] / (1.0 + z[:, None])
    true_mag = reference[:, None] + _rest_frame_colour(rest, galaxy_type)
    true_mag += rng.normal(0.0, 0.05, true_mag.shape)  # template mismatch: no galaxy is exactly the model
    extinction = np.stack([fields.column(f"ext_{b}").to_numpy()[field] for b in BANDS], axis=1)
    seeing = fields.column("seeing").to_numpy()[field][:, None]
    # error: 0.2 mag at 5 sigma depth, scaling with flux; worse seeing means a shallower image
    depth = DEPTH[None, :] - 1.25 * np.log10(seeing / 0.8) * 2
    mag = true_mag + extinction
    err = np.sqrt(0.015 ** 2 + (0.2 * 10 ** (0.4 * (mag - depth))) ** 2)
    observed = mag + rng.normal(size=mag.shape) * err
    detected = observed < depth + 0.7
    flags = np.zeros(mag.shape, dtype=np.int16)
    flags |= np.where(observed < 17.5, FLAG_SATURATED, 0).astype(np.int16)
    flags |= np.where(rng.random(mag.shape) < 0.02, FLAG_BLENDED, 0).astype(np.int16)
    bad_pixel = rng.random(mag.shape) < 0.01
    flags |= np.where(bad_pixel, FLAG_BAD_PIXEL, 0).astype(np.int16)
    observed = np.where(bad_pixel, observed + rng.normal(0, 1.5, mag.shape), observed)  # garbage values
    keep = detected.ravel()
    photometry = pa.table({
        "id": np.repeat(ids, len(BANDS))[keep],
        "band": pa.array(np.tile(np.array(BANDS), n)[keep]).dictionary_encode(),
        "mag": observed.ravel()[keep].astype(np.float32),
        "mag_err": err.ravel()[keep].astype(np.float32),
        "flags": flags.ravel()[keep],
    })
    return objects, photometry


def num_files(rows: int) -> int:
    """At least 8 files (so even a small survey is read in parallel), at most ROWS_PER_FILE rows each."""
    return max(8, int(math.ceil(rows / ROWS_PER_FILE)))


def rows_per_file(rows: int) -> int:
    return int(math.ceil(rows / num_files(rows)))


def _write(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd", row_group_size=65_536)
    os.replace(tmp, path)


def write_survey(out: str | os.PathLike[str], rows: int, *, seed: int = 42, rank: int = 0, size: int = 1) -> list[Path]:
    """Write this process's files of the survey (files ``rank, rank + size, ...``); returns them."""
    if not MIN_ROWS <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be between {MIN_ROWS} and {MAX_ROWS}, got {rows}")
    base = Path(out)
    for sub in ("objects", "photometry", "fields"):
        (base / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    fields = fields_table(rows, seed)
    written: list[Path] = []
    if rank == 0:
        _write(fields, base / "fields" / "fields.parquet")
        written.append(base / "fields" / "fields.parquet")
    for part in range(rank, num_files(rows), size):
        objects, photometry = objects_and_photometry(part, rows, seed, fields)
        for name, table in (("objects", objects), ("photometry", photometry)):
            path = base / name / f"part-{part:05d}.parquet"
            _write(table, path)
            written.append(path)
    return written


def survey_complete(out: str | os.PathLike[str], rows: int, seed: int) -> bool:
    marker = Path(out) / "_SUCCESS"
    try:
        return bool(json.loads(marker.read_text()) == {"rows": rows, "seed": seed})
    except (OSError, ValueError):
        return False


def mark_complete(out: str | os.PathLike[str], rows: int, seed: int) -> None:
    _write_text = json.dumps({"rows": rows, "seed": seed})
    marker = Path(out) / "_SUCCESS"
    tmp = marker.with_name(f"._SUCCESS.tmp-{os.getpid()}")
    tmp.write_text(_write_text)
    os.replace(tmp, marker)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=float, default=100_000,
                        help=f"number of galaxies ({MIN_ROWS:.0e} to {MAX_ROWS:.0e}; 1e6 is accepted)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    rows = int(args.rows)
    rank, size, comm = 0, 1, None
    if any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
    written = write_survey(args.out, rows, seed=args.seed, rank=rank, size=size)
    if comm is not None:
        comm.Barrier()
    if rank == 0:
        mark_complete(args.out, rows, args.seed)
        print(f"wrote {rows} galaxies in {num_files(rows)} file pairs to {args.out}")
    del written
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
