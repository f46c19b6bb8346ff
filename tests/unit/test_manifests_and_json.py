"""YAML manifests (errors name the file and key) and strict JSON parsing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from registry_server.domain import strict_json
from registry_server.domain.errors import InvalidArgument, InvalidDefinition
from registry_server.domain.manifests import load_manifest, load_manifests
from tests.factories import manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"


def write(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_example_manifests_all_load() -> None:
    names = {t.name for t in load_manifests(EXAMPLES)}
    assert {"echo", "word_count", "run_python", "write_file"} <= names


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    bad = write(
        tmp_path / "t.yaml", manifest(sandbox={"image": "x", "command": ["c"], "network": "host"})
    )
    with pytest.raises(InvalidDefinition) as info:
        load_manifest(bad)
    assert str(bad) in info.value.message
    assert "sandbox.network: unknown key" in info.value.message


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    bad = write(tmp_path / "t.yaml", "name: echo\ndescription: [unclosed\n")
    with pytest.raises(InvalidDefinition) as info:
        load_manifest(bad)
    assert str(bad) in info.value.message and "line 3" in info.value.message


def test_manifest_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(InvalidDefinition, match="must be a mapping"):
        load_manifest(write(tmp_path / "t.yaml", "- a\n- b\n"))


def test_unreadable_manifest(tmp_path: Path) -> None:
    with pytest.raises(InvalidDefinition, match="cannot read"):
        load_manifest(tmp_path / "missing.yaml")


def test_directory_with_two_files_of_one_name_fails_before_anything(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", manifest())
    write(tmp_path / "b.yml", manifest())
    (tmp_path / "notes.txt").write_text("ignored")
    with pytest.raises(InvalidDefinition, match="more than one file"):
        load_manifests(tmp_path)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ('{"a":1,"a":2}', "duplicate key 'a'"),
        ('{"a": NaN}', "NaN is not valid JSON"),
        ('{"a": Infinity}', "Infinity"),
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object, got array"),
        ('"s"', "got string"),
        ("1.5", "got number"),
        ("null", "got null"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_strict_json_rejects(text: str, rule: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        strict_json.loads_object(text, "arguments_json")
    assert info.value.violations[0].field == "arguments_json"
    assert rule in info.value.message


def test_strict_json_empty_default() -> None:
    assert strict_json.loads_object("  ", "f", empty_is={}) == {}
    assert strict_json.loads_object('{"b":1,"a":[1.0]}', "f") == {"b": 1, "a": [1.0]}
