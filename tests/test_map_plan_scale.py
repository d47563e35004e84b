"""What a map of many items costs the orchestrator per item: its key, and the texts it holds.

A map item's key is the digest of one JSON text (:func:`hetflow.mapping._digest` of the stage's key, the
kind, the item's identity and its turn; no parameter, as in a plain stage's key).  :func:`~hetflow.mapping.list_items` splices that text
from the item's JSON and the common part's, made once (dumping the stage's whole key once per item was most of
a 100,000-item map's plan): the keys must stay those of the one-dump formula, or every cached item of a store
runs again after an upgrade."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import hetflow as hf
from hetflow import mapping


def _reference(spec, stage_key, found):  # type: ignore[no-untyped-def]
    """The keys as the one-dump formula makes them, for ``found``: each item's identity in order."""
    keys, seen = [], {}
    for identity in found:
        text = json.dumps(identity, sort_keys=True, default=str)
        seen[text] = seen.get(text, -1) + 1
        data = {"stage": stage_key, "kind": spec.map_over.kind, "item": identity, "turn": seen[text]}
        keys.append(hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest())
    return keys


def test_map_item_keys_are_those_of_the_one_dump_formula(tmp_path: Path) -> None:
    pipe = hf.Pipeline("keys", pilot="local")
    grid = {"lr": [0.1, 1e-9, 0.1], "name": ["ü\u2603", "a\"b", None], "cfg": [{"z": 1, "a": [1, {"k": 2}]}]}

    @pipe.stage(map_over=grid, outputs=["out"])
    def fit(ctx):  # type: ignore[no-untyped-def]
        return {}

    (tmp_path / "data").mkdir()
    for name, text in (("b.csv", "1\n"), ("a.csv", "2\n"), ("c.csv", "1\n")):
        (tmp_path / "data" / name).write_text(text)

    @pipe.stage(map_over="files", files=["data/*.csv"], outputs=["out2"])
    def each(ctx):  # type: ignore[no-untyped-def]
        return {}

    stage_key = {"code": "abc", "files": {"x": Path("/p")}, "inputs": {"n": ["mapped", 3]}, "é": 1.5}
    items = mapping.list_items(pipe.stages["fit"], base=tmp_path, stage_key=stage_key, inputs={},
                               items_dir=tmp_path / "items")
    points = [{"point": point} for point in pipe.stages["fit"].map_over.points()]  # type: ignore[union-attr]
    assert len(items) == 9 and len({i.key for i in items}) == 9   # two equal points: told apart by their turn
    assert [i.key for i in items] == _reference(pipe.stages["fit"], stage_key, points)
    files = mapping.list_items(pipe.stages["each"], base=tmp_path, stage_key=stage_key, inputs={},
                               items_dir=tmp_path / "items")
    identities = [{"file": i.label, "content": c} for i, c in zip(files, mapping.file_digests(
        [tmp_path / i.label for i in files]))]
    assert [i.label for i in files] == ["data/a.csv", "data/b.csv", "data/c.csv"]
    assert [i.key for i in files] == _reference(pipe.stages["each"], stage_key, identities)
    again = files[0].again()
    assert again == files[0] and again.outputs is not files[0].outputs


def test_a_map_holds_one_copy_of_the_texts_its_items_repeat(tmp_path: Path) -> None:
    """Each item's result line repeats its output's schema, its node and its rank's log file; the orchestrator
    holds every item's result until the map's end (100,000 copies of a schema of some hundred bytes), so the
    results it reads, and the records of items it reuses, share one copy of each."""
    from types import SimpleNamespace

    from hetflow.mapshell import _merge
    from hetflow.tasks.protocol import AttemptFiles

    files = AttemptFiles(tmp_path)
    schema = "/////6gAAAAQAAAAAAAKAAwABgAFAAgACgAAAAABBAAMAAAACAAIAAAABAAIAAAABAAAAAIAAABE" * 3
    lines = [json.dumps({"index": i, "status": "ok", "log": [str(tmp_path / "rank-0.log"), i, i + 1],
                         "outputs": {"out": {"partition": {"file": f"part-{i}.arrow", "rows": 1, "bytes": 9,
                                                           "checksum": "crc32:0", "node": "localhost", "rank": 0},
                                             "schema": schema}}}) for i in range(3)]
    files.item_results(0).write_text("\n".join(lines) + "\n")
    merged = _merge(files, 1)
    parts = [merged[i]["outputs"]["out"][0] for i in range(3)]
    assert [p["file"] for p in parts] == ["part-0.arrow", "part-1.arrow", "part-2.arrow"]
    assert parts[0]["schema"] == schema and parts[1]["schema"] is parts[0]["schema"] is parts[2]["schema"]
    assert parts[1]["node"] is parts[0]["node"]
    assert merged[2]["log"] == [str(tmp_path / "rank-0.log"), 2, 3] and merged[2]["log"][0] is merged[0]["log"][0]
    # reused: each earlier record's outputs and directory, as the store gives them (a new text each)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "part-0.arrow").write_bytes(b"123456789")
    part = {"file": "part-0.arrow", "rows": 1, "bytes": 9, "checksum": "crc32:cbf43926", "node": "localhost",
            "rank": 0}
    items = [mapping.Item(i, f"k{i}", str(i), ("point", {"i": i})) for i in range(2)]
    earlier = {f"k{i}": [SimpleNamespace(run_id="r0", cached_from=None, directory=(str(tmp_path) + "/x")[:-2],
                                         outputs=json.loads(json.dumps({"out": [{**part, "schema": schema}]})))]
               for i in range(2)}
    assert earlier["k0"][0].directory is not earlier["k1"][0].directory
    mapping.reusable(items, earlier, "r1")
    assert [i.state for i in items] == ["CACHED", "CACHED"] and items[0].cached_from == "r0"
    assert items[0].directory is items[1].directory
    assert items[0].outputs["out"][0]["schema"] is items[1].outputs["out"][0]["schema"]


def test_a_manifest_is_written_as_json_dumps_would_without_holding_every_piece(tmp_path: Path) -> None:
    """The manifest of a map's output has a partition per item; ``json.dumps`` with an indent held a list of
    every piece of its text (a few per value) before joining them: more memory than the text many times over,
    the peak of a 100,000-item map's end.  Written as encoded, the file is the same bytes."""
    import tracemalloc

    from hetflow.operators.dataset import write_json_atomic

    data = {"format": 1, "schema": "s" * 300, "partitions": [
        {"file": f"part-{i:06d}.arrow", "rows": 128, "bytes": 2650 + i, "checksum": f"crc32:{i:08x}",
         "node": "localhost", "rank": 0, "when": Path("/p")} for i in range(20_000)]}
    text = json.dumps(data, indent=1, sort_keys=True, default=str).encode()
    tracemalloc.start()
    try:
        write_json_atomic(tmp_path / "m.json", data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (tmp_path / "m.json").read_bytes() == text
    assert peak < len(text), (peak, len(text))
