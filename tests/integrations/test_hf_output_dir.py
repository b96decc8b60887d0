"""What DatastatesTrainer leaves in ``output_dir`` when ``train()`` returns: the
``checkpoint-N`` folders Trainer names and nothing else (no ``latest`` hint, no lease file), and
no datastates thread running; a second ``train()`` resumes from them."""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import datastates  # noqa: E402
from datastates.integrations.hf import DatastatesTrainer  # noqa: E402

from test_hf import args, dataset, tiny_model  # noqa: E402
from testkit import ONE_WRITER  # noqa: E402

# slow: a Hugging Face Trainer run
pytestmark = pytest.mark.slow


@pytest.fixture
def ours():
    """The datastates threads started since the test began (not those of other tests)."""
    before = set(threading.enumerate())
    return lambda: sorted(
        t.name for t in threading.enumerate() if t.name.startswith("datastates") and t not in before
    )


def test_train_leaves_only_checkpoint_folders_and_no_thread(tmp_path, ours):
    t = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path, save_steps=4),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    t.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-8"]
    assert not ours()
    t.args.max_steps = 12
    t.train(resume_from_checkpoint=True)  # reopens what the first train() closed
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert not ours()
    assert t.latest_checkpoint() == str(tmp_path / "checkpoint-12")
    t.close_checkpointer()
    ckpt = datastates.Checkpointer(tmp_path, ONE_WRITER)
    assert ckpt.load(tag="checkpoint-12", keys="trainer_state")["trainer_state"]
    ckpt.close()
