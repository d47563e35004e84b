"""A map item's key is the digest of one JSON text (:func:`hetflow.mapping._digest` of the stage's key, the
parameters, the kind, the item's identity and its turn).  :func:`~hetflow.mapping.list_items` splices that text
from the item's JSON and the common part's, made once (dumping the stage's whole key once per item was most of
a 100,000-item map's plan): the keys must stay those of the one-dump formula, or every cached item of a store
runs again after an upgrade."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import hetflow as hf
from hetflow import mapping


def _reference(spec, stage_key, params, found):  # type: ignore[no-untyped-def]
    """The keys as the one-dump formula makes them, for ``found``: each item's identity in order."""
    keys, seen = [], {}
    for identity in found:
        text = json.dumps(identity, sort_keys=True, default=str)
        seen[text] = seen.get(text, -1) + 1
        data = {"stage": stage_key, "params": dict(params), "kind": spec.map_over.kind, "item": identity,
                "turn": seen[text]}
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
    params = {"seed": 7, "when": Path("/t"), "nested": {"b": 2, "a": 1}}
    items = mapping.list_items(pipe.stages["fit"], base=tmp_path, stage_key=stage_key, params=params, inputs={},
                               items_dir=tmp_path / "items")
    points = [{"point": point} for point in pipe.stages["fit"].map_over.points()]  # type: ignore[union-attr]
    assert len(items) == 9 and len({i.key for i in items}) == 9   # two equal points: told apart by their turn
    assert [i.key for i in items] == _reference(pipe.stages["fit"], stage_key, params, points)
    files = mapping.list_items(pipe.stages["each"], base=tmp_path, stage_key=stage_key, params=params, inputs={},
                               items_dir=tmp_path / "items")
    identities = [{"file": i.label, "content": c} for i, c in zip(files, mapping.file_digests(
        [tmp_path / i.label for i in files]))]
    assert [i.label for i in files] == ["data/a.csv", "data/b.csv", "data/c.csv"]
    assert [i.key for i in files] == _reference(pipe.stages["each"], stage_key, params, identities)
    again = files[0].again()
    assert again == files[0] and again.outputs is not files[0].outputs
