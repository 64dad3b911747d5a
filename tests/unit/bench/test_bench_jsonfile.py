"""bench/ reads JSON files one way: the document, or a one-line ConfigError naming the file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark.bench.jsonfile import read_json
from dspark.errors import ConfigError


def test_reads_the_document(tmp_path):
    (tmp_path / "a.json").write_text('{"data": [1, 2]}')
    assert read_json(tmp_path / "a.json") == {"data": [1, 2]}


@pytest.mark.parametrize("content, message", [(None, "cannot read: No such file or directory"),
                                              (b"{not json", "not JSON: "), (b"\xff\xfe", "not JSON: ")])
def test_a_missing_or_broken_file_is_a_config_error_naming_it(tmp_path, content, message):
    path = tmp_path / "a.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        read_json(path, "input-data")
    text = str(info.value)
    assert message in text and str(path) in text and "input-data" in text and "\n" not in text


def test_bench_has_no_other_json_file_reader():
    import dspark.bench

    package = Path(dspark.bench.__file__).parent
    readers = [f"{p.relative_to(package)}" for p in package.rglob("*.py") if p.name != "jsonfile.py"
               and re.search(r"json\.loads?\([^)]*read_(text|bytes)\(|json\.load\(", p.read_text())]
    assert not readers, readers
