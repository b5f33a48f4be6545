"""Shared fixtures: a tiny HF model folder and a small arithmetic dataset, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from reinforge.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture(scope="session")
def arithmetic_data_dir(tmp_path_factory) -> Path:
    from reinforge.data.tasks.arithmetic import write_arithmetic_dataset

    folder = tmp_path_factory.mktemp("arithmetic")
    write_arithmetic_dataset(folder, num_train=64, num_test=8, max_digits=2)
    return folder
