"""RunOutputs: a CSV log in the output, appended call by call, carried by branches like any file; files drawn when
wanted."""
import csv
import io

import pytest

from recipe_engine.execution.outputs import RunOutputs


def test_rows_append_to_one_csv_file_that_branches_carry():
    outputs = RunOutputs()
    outputs.add_rows("log.csv", [{"layer": 0, "error": 0.25, "note": None}])
    branch = outputs.copy_for({})
    branch.add_rows("log.csv", [{"layer": 1, "error": 1 / 3, "note": "a, b"}])
    read = lambda o: list(csv.DictReader(io.StringIO(o.artifacts["log.csv"].decode())))
    assert read(outputs) == [{"layer": "0", "error": "0.25", "note": ""}]
    assert read(branch)[1] == {"layer": "1", "error": repr(1 / 3), "note": "a, b"}  # floats exactly, quoted commas
    outputs.adopt(branch)
    assert [row["layer"] for row in read(outputs)] == ["0", "1"]
    with pytest.raises(ValueError, match="differ"):
        outputs.add_rows("log.csv", [{"layer": 2}])
    with pytest.raises(ValueError, match=r"\.csv"):
        outputs.add_rows("log.txt", [{"layer": 2}])


def test_an_artifact_given_as_a_function_is_drawn_once_and_only_when_wanted():
    """A plot handed over as a function is drawn when the files are read (written or checkpointed), once; a
    branch that is dropped never draws its own, and a row log beside it does not draw it either."""
    drawn = []

    def draw(name):
        return lambda: drawn.append(name) or name.encode()

    outputs = RunOutputs()
    outputs.add_artifact("kept.png", draw("kept"))
    branch = outputs.copy_for({})
    branch.add_artifact("lost.png", draw("lost"))
    outputs.add_rows("log.csv", [{"a": 1}])
    assert drawn == []
    assert outputs.artifacts["kept.png"] == b"kept" and outputs.artifacts["kept.png"] == b"kept"
    assert drawn == ["kept"]
    del branch
    assert drawn == ["kept"]
