"""train.threads: the trainer's CPU thread count, set when given, resume-neutral."""

from __future__ import annotations

import logging

import pytest
import torch

from looplm.config_base import ConfigError
from looplm.train import Trainer, TrainConfig
from tests.train.helpers import run_config


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_sets_torch_threads_and_null_leaves_them(tmp_path, restore_threads):
    torch.set_num_threads(2)
    Trainer(run_config(tmp_path / "default", max_steps=2), progress=False)
    assert torch.get_num_threads() == 2
    Trainer(run_config(tmp_path / "one", max_steps=2, threads=1), progress=False)
    assert torch.get_num_threads() == 1


def test_changing_threads_on_resume_is_not_reported_as_a_difference(tmp_path, caplog, restore_threads):
    Trainer(run_config(tmp_path / "run", max_steps=4, save_every=2, threads=1), progress=False).fit(stop_after=2)
    with caplog.at_level(logging.WARNING, logger="looplm"):
        trainer = Trainer(run_config(tmp_path / "run", max_steps=4, save_every=2, threads=2), resume=True,
                          progress=False)
    assert trainer.step == 2 and torch.get_num_threads() == 2 and "differ" not in caplog.text


@pytest.mark.parametrize("threads", [0, -1])
def test_threads_below_one_are_refused(threads):
    with pytest.raises(ConfigError, match="train.threads.*integer >= 1"):
        TrainConfig(threads=threads)
