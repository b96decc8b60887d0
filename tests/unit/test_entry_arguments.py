"""Every entry point that names a checkpoint (``save``, ``restore``, ``load``, ``delete``) refuses
a bad step, tag or persist with one check (``save.arguments.check_target``), run before a memory
tier routes anything: the same ConfigError, ``"<call>(): <expected>, found <value>"``, on the
plain Checkpointer, on one with a memory tier, and on that tier's own Checkpointer; nothing is
written and the live state is left as it was."""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

import pytest
import torch

import datastates
from datastates import CheckpointConfig, Checkpointer, ConfigError
from datastates.tools.keeper import ask

SMALL = dict(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)
STEP = re.escape("step must be an int in [0, 2**63 - 1], found ")
NAME = re.escape("invalid checkpoint name ")

#: (step=, tag=, the message after "<call>(): ")
BAD = [
    pytest.param(step, tag, expected, id=f"step={step!r}" if tag is None else f"tag={tag!r}"[:20])
    for step, tag, expected in [
        ("4", None, STEP + re.escape("'4'")),
        (True, None, STEP + "True"),
        (-1, None, STEP + "-1"),
        (2**63, None, STEP + str(2**63)),
        (3.0, None, STEP + "3.0"),
        (None, "../x", NAME + re.escape("'../x': expected a non-empty path component")),
        (None, "", NAME + re.escape("'': expected a non-empty path component")),
        (None, "a/b", NAME + re.escape("'a/b': expected")),
        (None, ".hidden", NAME + re.escape("'.hidden': expected")),
        (None, "latest", NAME + re.escape("'latest': expected")),
        (None, 7, NAME + re.escape("7: expected")),
        (None, "a\nb", NAME + re.escape("'a\\nb': it holds the control character '\\n'")),
        (None, "x" * 129, NAME + ".*129 bytes in UTF-8, expected at most 128"),
    ]
]

#: Every entry point, called with step= and tag= only (and a state where it takes one).
CALLS = {
    "save": lambda ck, step, tag: ck.save({"w": torch.ones(2)}, step, tag=tag),
    "restore": lambda ck, step, tag: ck.restore({"w": torch.zeros(2)}, step, tag=tag),
    "load": lambda ck, step, tag: ck.load(step, tag=tag),
    "delete": lambda ck, step, tag: ck.delete(step, tag=tag),
}


@pytest.fixture(scope="module")
def checkpointers(tmp_path_factory):
    """{"plain", "tiered", "memory"}: a plain Checkpointer, one with a memory tier (its keeper
    started once for the module), and the latter's memory Checkpointer; step 1 saved in each."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    shm = tempfile.mkdtemp(prefix="ds-test-", dir=base)
    root = tmp_path_factory.mktemp("entry")
    tier = datastates.MemoryTier(root=shm, persist_every=2, log_path=str(root / "keeper.log"))
    plain = Checkpointer(root / "plain", CheckpointConfig(**SMALL))
    tiered = Checkpointer(root / "tiered", CheckpointConfig(memory_tier=tier, **SMALL))
    try:
        plain.save({"w": torch.ones(2)}, step=1).wait(60)
        tiered.save({"w": torch.ones(2)}, step=1).wait(60)  # into memory (persist_every=2)
        yield {"plain": plain, "tiered": tiered, "memory": tiered.memory}
    finally:
        plain.close()
        tiered.close(stop_keeper=True)
        for memdir in glob.glob(os.path.join(shm, "datastates-*")):
            try:
                ask(memdir, "stop", timeout=60)
            except datastates.KeeperError:
                pass
        shutil.rmtree(shm, ignore_errors=True)


def _listing(ck) -> list[str]:
    """The names in every tier of ``ck`` (the memory tier's TierCheckpointer has one)."""
    memory = getattr(ck, "memory", None)
    return [i.name for i in ck.list()] + ([i.name for i in memory.list()] if memory else [])


@pytest.mark.parametrize("which", ["plain", "tiered", "memory"])
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("step, tag, expected", BAD)
def test_a_bad_step_or_tag_is_the_same_config_error_at_every_entry_point(
    checkpointers, which, call, step, tag, expected
):
    ck = checkpointers[which]
    before = _listing(ck)
    with pytest.raises(ConfigError) as info:
        CALLS[call](ck, step, tag)
    assert re.fullmatch(re.escape(f"{call}(): ") + expected + ".*", str(info.value), re.DOTALL), (
        str(info.value)
    )
    assert _listing(ck) == before


@pytest.mark.parametrize("which", ["plain", "tiered", "memory"])
@pytest.mark.parametrize("persist", [0, 1, "yes", 1.0])
def test_persist_other_than_a_bool_or_none_is_refused_before_routing(checkpointers, which, persist):
    """With a memory tier, persist=0 would have gone to memory and persist=1 to storage by
    their truth; without one both went to storage."""
    ck = checkpointers[which]
    before = _listing(ck)
    with pytest.raises(ConfigError) as info:
        ck.save({"w": torch.ones(2)}, step=5, persist=persist)
    assert str(info.value) == f"save(): persist must be None, True or False, found {persist!r}"
    assert _listing(ck) == before


@pytest.mark.parametrize("which", ["plain", "tiered"])
def test_a_call_without_the_checkpoint_it_needs_is_a_config_error(checkpointers, which):
    ck = checkpointers[which]
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "save(): a step= or a tag= (or both) names the checkpoint, found step=None, tag=None"
        ),
    ):
        ck.save({"w": torch.ones(2)})
    for step, tag in ((None, None), (1, "best")):
        with pytest.raises(
            ConfigError,
            match=re.escape(
                f"delete(): exactly one of step= or tag= names the checkpoint, found "
                f"step={step!r}, tag={tag!r}"
            ),
        ):
            ck.delete(step, tag=tag)
    for call in ("restore", "load"):
        with pytest.raises(
            ConfigError,
            match=re.escape(
                f"{call}(): at most one of step= or tag= names the checkpoint, found step=1, "
                f"tag='best'"
            ),
        ):
            getattr(ck, call)(
                *(({"w": torch.ones(2)},) if call == "restore" else ()), 1, tag="best"
            )
    assert 1 in [i.step for i in ck.list() + (ck.memory.list() if ck.memory else [])]
