"""Repository operations and `dspark repo` as a user runs them."""
from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.paths import project_root
from dspark.repository import repo
from dspark.repository.modelspec import ModelSpec, SpecError

DEMO_ONNX = project_root() / "model_repository/mlp_classifier/1/model.onnx"


@pytest.fixture
def repository(tmp_path):
    path = tmp_path / "models"
    path.mkdir()
    return path


def test_add_creates_a_model_from_an_onnx_file_and_maps_versions_to_folders(repository):
    first = repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    second = repo.add_version(repository, "clf", DEMO_ONNX, "1.1.0")
    assert (first.folder, second.folder) == (1, 2)
    assert (repository / "clf/2/model.onnx").is_file()
    spec = ModelSpec.load(repository / "clf/modelspec.yaml")
    assert [(r.semver, r.folder) for r in spec.versions] == [("1.0.0", 1), ("1.1.0", 2)]
    assert spec.inputs[0].name == "features" and spec.max_batch_size == 8
    assert repo.validate([repository]) == []


def test_add_refuses_a_version_that_is_not_newer(repository):
    repo.add_version(repository, "clf", DEMO_ONNX, "2.0.0")
    with pytest.raises(SpecError, match="not newer"):
        repo.add_version(repository, "clf", DEMO_ONNX, "1.9.9")
    assert not (repository / "clf/2").exists()


def test_validate_names_file_and_field_of_a_broken_config(repository):
    repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    config = repository / "clf/config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 0"))
    problems = repo.validate([repository])
    fields = {(p.path.name, p.field) for p in problems}
    assert ("config.pbtxt", "dynamic_batching") in fields  # batching without a batch size
    assert ("config.pbtxt", "max_batch_size") in fields  # drifted from modelspec.yaml


def test_validate_reports_a_missing_artifact_and_a_bad_ensemble(repository):
    repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    (repository / "clf/1/model.onnx").unlink()
    ensemble = repository / "pipeline"
    (ensemble / "1").mkdir(parents=True)
    (ensemble / "config.pbtxt").write_text(
        'name: "pipeline" platform: "ensemble" max_batch_size: 8 '
        'input [{name: "x" data_type: TYPE_FP32 dims: [16]}] output [{name: "y" data_type: TYPE_FP32 dims: [4]}] '
        'ensemble_scheduling { step [{ model_name: "clf" model_version: -1 input_map { key: "features" value: "x" } '
        'output_map { key: "logits" value: "y" } }] }')
    messages = [str(p) for p in repo.validate([repository])]
    assert any("clf/1" in m and "missing model.onnx" in m for m in messages), messages
    assert any("ensemble_scheduling.step[0].output_map" in m and "logits" in m for m in messages), messages


def test_init_adopts_plain_triton_models(repository):
    shutil.copytree(project_root() / "model_repository/mlp_classifier", repository / "plain",
                    ignore=shutil.ignore_patterns("modelspec.yaml"))
    config = repository / "plain/config.pbtxt"
    config.write_text(config.read_text().replace('"mlp_classifier"', '"plain"'))
    written = repo.init_repository(repository)
    assert [p.parent.name for p in written] == ["plain"]
    spec = ModelSpec.load(repository / "plain/modelspec.yaml")
    assert [(r.semver, r.folder) for r in spec.versions] == [("1.0.0", 1)]
    assert repo.validate([repository]) == []


def test_cli_validate_exits_1_and_names_file_and_field(repository):
    repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    (repository / "clf/config.pbtxt").write_text('name: "clf"\nbackend: "onnx"\nmax_batch: 8\n')
    result = CliRunner().invoke(cli, ["repo", "validate", str(repository)])
    assert result.exit_code == 1
    assert "clf/config.pbtxt" in result.output and "max_batch" in result.output


def test_cli_demo_repositories_are_valid_and_listed():
    runner = CliRunner()
    result = runner.invoke(cli, ["repo", "validate"])
    assert result.exit_code == 0, result.output
    listing = runner.invoke(cli, ["repo", "list"]).output
    assert "mlp_classifier" in listing and "1.0.0->1" in listing and "scaled_classifier" in listing


@pytest.mark.parametrize("name", ["../x", "..", ".", "a/b", "ABSOLUTE", ".hidden", "two words", "x" * 129, ""])
def test_add_refuses_a_model_name_that_is_not_a_folder_name_and_writes_nothing(tmp_path, name):
    repository = tmp_path / "deep/models"
    repository.mkdir(parents=True)
    name = str(tmp_path / "elsewhere") if name == "ABSOLUTE" else name
    result = CliRunner().invoke(cli, ["repo", "add", name, str(DEMO_ONNX), "--version", "1.0.0", "-r", str(repository)])
    assert result.exit_code == 1
    assert f"name: {name!r} is not a valid model name: use letters, digits" in result.output
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [tmp_path.joinpath("deep").relative_to(tmp_path),
                                                                            repository.relative_to(tmp_path)]


def test_add_refuses_a_model_folder_that_links_out_of_the_repository(tmp_path):
    repository, outside = tmp_path / "models", tmp_path / "outside"
    repository.mkdir()
    outside.mkdir()
    (repository / "clf").symlink_to(outside)
    result = CliRunner().invoke(cli, ["repo", "add", "clf", str(DEMO_ONNX), "--version", "1.0.0", "-r", str(repository)])
    assert result.exit_code == 1
    assert f"{repository / 'clf'}: is a link to {outside}, outside the repository" in result.output
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("filename", ["modelspec.yaml", "config.pbtxt"])
def test_validate_names_a_file_that_is_not_utf8(repository, filename):
    repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    path = repository / "clf" / filename
    path.write_bytes(path.read_bytes().replace(b"clf", b"cl\xe9f", 1))
    result = CliRunner().invoke(cli, ["repo", "validate", str(repository)])
    assert result.exit_code == 1
    assert f"error: {path}: is not UTF-8 text (byte 0xe9 at offset" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("hostile, why", [
    ("a: " + "[" * 100_000 + "]" * 100_000, "nests lists or mappings deeper than 64 levels (line 1, column 67)"),
    ("- " * 100_000 + "x", "nests lists or mappings deeper than 64 levels"),
    ("name: clf\n" + "#" * (50 * 1024 * 1024), "is larger than 256 KiB, the most a model's spec or config may be"),
])
def test_validate_reports_a_hostile_modelspec_in_one_line_and_goes_on(repository, hostile, why):
    """100,000 nested brackets were a RecursionError that ended the whole report; a 50 MB spec
    took 48 s and 185 MB before "ok"."""
    repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    repo.add_version(repository, "good", DEMO_ONNX, "1.0.0")
    (repository / "good/config.pbtxt").write_text((repository / "good/config.pbtxt").read_text() + "max_batch: 8\n")
    path = repository / "clf/modelspec.yaml"
    path.write_text(hostile)
    result = CliRunner().invoke(cli, ["repo", "validate", str(repository)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith(f"error: {path}: {why}") and len(errors[0]) < 400, errors
    assert any(f"{repository / 'good/config.pbtxt'}:" in line and "max_batch" in line for line in errors), \
        "the other model is still reported"


def test_validate_quotes_a_config_pbtxt_error_in_one_short_line(repository):
    repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    path = repository / "clf/config.pbtxt"
    path.write_text('parameters { key: "a" value ' + "{" * 100_000 + "}" * 100_001)
    problems = [str(p) for p in repo.validate([repository])]
    assert problems[0].startswith(f"{path}: 1:30 : ") and len(problems[0]) < 400, problems[0][:500]


@pytest.mark.parametrize("link", ["folder", "modelspec.yaml", "config.pbtxt"])
def test_validate_reports_a_model_that_links_out_of_the_repository_and_does_not_read_it(tmp_path, link):
    repository, outside = tmp_path / "models", tmp_path / "outside"
    repo.add_version(repository, "clf", DEMO_ONNX, "1.0.0")
    shutil.copytree(repository / "clf", outside)
    (outside / "config.pbtxt").write_text('name: "secret"\n')
    if link == "folder":
        shutil.rmtree(repository / "clf")
        (repository / "clf").symlink_to(outside)
        where, target = repository / "clf", outside
    else:
        (repository / "clf" / link).unlink()
        (repository / "clf" / link).symlink_to(outside / link)
        where, target = repository / "clf" / link, outside / link
    result = CliRunner().invoke(cli, ["repo", "validate", str(repository)])
    assert result.exit_code == 1
    assert f"error: {where}: is a link to {target}, outside the repository" in result.output
    assert "secret" not in result.output
    for command in (["repo", "sync", "-r", str(repository)], ["repo", "init", str(repository)]):
        if link == "folder":
            result = CliRunner().invoke(cli, command)
            assert result.exit_code == 1 and f"{where}: is a link to {target}, outside the repository" in result.output
    assert (outside / "config.pbtxt").read_text() == 'name: "secret"\n', "nothing written through the link"
