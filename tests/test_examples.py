"""The example configs ship in the wheel, and ``reinforge init`` writes them where a user trains from."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from reinforge.cli import main
from reinforge.config import load_config
from reinforge.examples import COMMANDS, EXAMPLES, FOLDER

REPO = Path(__file__).resolve().parents[1]
FILES = sorted({name for files in EXAMPLES.values() for name in files})


def test_init_writes_every_example_into_examples_and_keeps_what_is_there(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    assert sorted(path.name for path in (tmp_path / "examples").iterdir()) == FILES
    for name in FILES:
        assert (tmp_path / "examples" / name).read_text() == (FOLDER / name).read_text()
    out = capsys.readouterr().out
    assert "wrote examples/retool_tools.yaml" in out and "next: reinforge train examples/grpo_gsm8k.yaml" in out
    for name in set(EXAMPLES) - set(COMMANDS):  # each config loads and validates, the README's commands as written
        config = load_config(f"examples/{EXAMPLES[name][0]}", ["model.path=/m"])
        if name == "retool":
            assert Path(config.rollout.multi_turn.tool_config_path).is_file()

    (tmp_path / "examples" / "ppo_gsm8k.yaml").write_text("# mine\n")
    assert main(["init"]) == 2  # nothing written over: a user's edits stay
    assert capsys.readouterr().err.strip() == (  # the files as init wrote them are not in the way
        "error: examples/ppo_gsm8k.yaml already exist(s); reinforge init keeps them: pass --force to write over them, "
        "or another folder")
    assert (tmp_path / "examples" / "ppo_gsm8k.yaml").read_text() == "# mine\n"
    assert main(["init", "ppo_gsm8k", "--force"]) == 0
    assert (tmp_path / "examples" / "ppo_gsm8k.yaml").read_text() == (FOLDER / "ppo_gsm8k.yaml").read_text()


def test_init_of_one_example_into_another_folder_points_it_at_its_own_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "retool", "recipes/retool"]) == 0
    assert sorted(path.name for path in (tmp_path / "recipes" / "retool").iterdir()) == ["retool.yaml",
                                                                                        "retool_tools.yaml"]
    config = load_config("recipes/retool/retool.yaml", ["model.path=/m"])
    assert config.rollout.multi_turn.tool_config_path == "recipes/retool/retool_tools.yaml"
    assert "reinforge train recipes/retool/retool.yaml" in (tmp_path / "recipes" / "retool" / "retool.yaml").read_text()
    (tmp_path / "notes").write_text("mine\n")
    assert main(["init", "retool", "notes"]) == 2  # it was "[Errno 17] File exists: 'notes'"
    assert capsys.readouterr().err.strip() == ("error: notes is a file, not a folder; reinforge init writes the "
                                               "examples into a folder: give another one")
    assert main(["train", "examples/grpo_gsm8k.yaml"]) == 2  # before reinforge init: the line says what writes it
    assert capsys.readouterr().err.strip() == (f"error: config file examples/grpo_gsm8k.yaml does not exist (looked "
                                               f"for {(tmp_path / 'examples' / 'grpo_gsm8k.yaml').resolve()}); pass a YAML file "
                                               "such as examples/grpo_gsm8k.yaml, which reinforge init writes")
    assert main(["init", "grpo"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "reinforge init grpo: no example of that name; the examples are grpo_gsm8k, dapo_gsm8k, ppo_gsm8k, retool, rm, "
        "dpo (or all); reinforge init all DIR writes them all into DIR")


@pytest.mark.parametrize("folder", ["proj/examples", "examples/rm", "ABSOLUTE/examples", "my #runs, a: b"])
@pytest.mark.parametrize("name", ["rm", "retool"])
def test_init_into_a_folder_named_examples_points_each_config_at_its_own_files(tmp_path, monkeypatch, capsys, name,
                                                                              folder):
    """rm's and dpo's shared sample pairs were rewritten twice (proj/examples got proj/proj/examples/... paths); a
    folder name YAML reads otherwise is quoted."""
    monkeypatch.chdir(tmp_path)
    folder = folder.replace("ABSOLUTE", tmp_path.as_posix())
    assert main(["init", name, folder]) == 0
    config = yaml.safe_load(Path(f"{folder}/{EXAMPLES[name][0]}").read_text())
    named = ([config["rollout"]["multi_turn"]["tool_config_path"]] if name == "retool"
             else [*config["data"]["train_files"], *config["data"]["val_files"]])
    assert named and all(path.startswith(f"{folder}/") and Path(path).is_file() for path in named), named


@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_the_preference_starters_run_as_written_on_their_sample_pairs(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                       command):
    """``reinforge init rm`` (or dpo) into a folder of its own: the config it writes loads and passes every check
    of its command that runs before a model loads (its sample pairs' rows too), then trains a step on a tiny model."""
    from reinforge.config.preference_schema import load_dpo_config, load_rm_config
    from reinforge.trainer.preference.pairs import preflight_preference

    monkeypatch.chdir(tmp_path)
    assert main(["init", command, "starters"]) == 0
    assert sorted(path.name for path in (tmp_path / "starters").iterdir()) == sorted(EXAMPLES[command])
    assert f"next: reinforge {command} starters/{command}.yaml model.path=... (see" in capsys.readouterr().out
    load = load_rm_config if command == "rm" else load_dpo_config
    config = load(f"starters/{command}.yaml", [f"model.path={tiny_model_dir}"])
    assert config.data.train_files == ["starters/preference_pairs.jsonl"]
    assert config.data.val_files == ["starters/preference_pairs_val.jsonl"]
    preflight_preference(config)
    quick = [f"model.path={tiny_model_dir}", "trainer.total_steps=1", "trainer.device=cpu", "trainer.loggers=[jsonl]",
             "data.max_val_samples=4", "trainer.max_tokens_per_micro_batch=4096"]
    assert main([command, f"starters/{command}.yaml", *quick]) == 0
    assert (tmp_path / "runs" / command / "checkpoints").is_dir()


def test_init_of_both_preference_starters_into_one_folder_shares_their_sample_pairs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "rm"]) == 0
    pairs = (tmp_path / "examples" / "preference_pairs.jsonl").stat().st_mtime_ns
    assert main(["init", "dpo"]) == 0  # was: preference_pairs.jsonl already exists
    assert (tmp_path / "examples" / "dpo.yaml").read_text() == (FOLDER / "dpo.yaml").read_text()
    assert (tmp_path / "examples" / "preference_pairs.jsonl").stat().st_mtime_ns == pairs
    (tmp_path / "examples" / "preference_pairs.jsonl").write_text("{}\n")
    assert main(["init", "rm"]) == 2  # edited pairs are still kept
    assert "examples/rm.yaml" not in capsys.readouterr().err


def test_the_repository_holds_one_copy_of_each_example():
    assert not (REPO / "examples").exists() or not list((REPO / "examples").glob("*.yaml"))
    assert sorted(path.name for path in FOLDER.iterdir() if path.suffix in (".yaml", ".jsonl")) == FILES


def test_the_wheel_holds_the_examples_and_its_reinforge_init_writes_them(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "reinforge", source / "reinforge", ignore=shutil.ignore_patterns("__pycache__"))
    # the project's build backend, as pip wheel --no-build-isolation calls it (without pip's own start-up)
    built = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "build_meta.build_wheel(sys.argv[1])", str(tmp_path / "wheels")], cwd=source,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (tmp_path / "wheels").glob("reinforge-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert {f"reinforge/examples/{name}" for name in FILES} | {"reinforge/examples/__init__.py"} <= names
        archive.extractall(tmp_path / "installed")
    written = tmp_path / "work"
    written.mkdir()
    init = subprocess.run([sys.executable, "-c", "import sys; from reinforge.cli import main; sys.exit(main())",
                           "init"], cwd=written, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tmp_path / "installed"), "PATH": "/usr/bin:/bin"})
    assert init.returncode == 0, init.stderr[-2000:]
    assert sorted(path.name for path in (written / "examples").iterdir()) == FILES
