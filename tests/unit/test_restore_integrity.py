"""What is restored is exactly what was saved, or a typed error with nothing modified.

- restore()/load() right after save() wait for that save: the checkpoint holds the state at
  save(), the restore gives the requested checkpoint;
- a strict restore is all-or-nothing: every check (keys, lengths, shapes, dtypes, types of plain
  values, the providers' own checks) runs before one byte of live state changes; each test
  compares every live tensor and value bit for bit before and after the failed restore.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import datastates
from datastates import Checkpointer, StateMismatchError
from datastates.providers.builtin import OPTIMIZER_CLASS_KEY

from helpers import assert_same, clone_state
from testkit import SMALL


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))


def _step(model, opt, seed: int = 0) -> None:
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(state: dict) -> dict:
    """Every tensor and value of a live state, copied (the reference for bit-exact checks)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            out[k] = clone_state(dict(v.state_dict()))
        elif isinstance(v, torch.optim.Optimizer):
            out[k] = copy.deepcopy(v.state_dict())
        elif hasattr(v, "state_dict"):
            out[k] = copy.deepcopy(v.state_dict())
        else:
            out[k] = clone_state(copy.deepcopy(v))
    return out


def _training(seed: int, opt_factory=None):
    model = _model(seed)
    opt = (opt_factory or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(model.parameters())
    _step(model, opt, seed)
    return {
        "model": model,
        "opt": opt,
        "extra": {"epoch": seed, "history": [0.5, float(seed)], "t": torch.full((5,), float(seed))},
    }


# ------------------------------------------------------------------ restore waits for saves


def test_restore_right_after_save_restores_the_requested_step_and_commits_the_saved_one(tmp_path):
    """save(step=1000) then at once restore(step=900), before any optimizer step: the committed
    step 1000 holds exactly the state at save(), the live state is step 900's."""
    state = _training(1)
    sched = torch.optim.lr_scheduler.StepLR(state["opt"], step_size=1, gamma=0.5)
    state["sched"] = sched
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.save(state, step=900).wait()
        at_900 = _snapshot(state)
        for i in range(3):
            _step(state["model"], state["opt"], 10 + i)
            sched.step()
        state["extra"]["epoch"] = 7
        at_1000 = _snapshot(state)
        handle = ck.save(state, step=1000)
        report = ck.restore(state, step=900)
        assert handle.done() and report.step == 900
        assert_same(_snapshot(state), at_900)
        assert ck.latest().name == "step-0000001000"
        saved = ck.load(step=1000)
        assert_same(saved["model"], at_1000["model"])
        assert_same(saved["opt"], at_1000["opt"])
        assert_same(saved["sched"], at_1000["sched"])
        assert_same(saved["extra"], at_1000["extra"])


def test_load_right_after_save_sees_it(tmp_path):
    with Checkpointer(tmp_path, SMALL) as ck:
        t = torch.randn(50_000)
        ck.save({"t": t}, step=1)
        assert torch.equal(ck.load()["t"], t)


def test_restore_waits_for_a_sharers_save_and_leaves_its_failure_on_the_handle(
    tmp_path, monkeypatch
):
    """A failing in-flight save of a Checkpointer sharing the pipeline: restore waits for it and
    succeeds; the failure stays on that save's handle."""
    owner = Checkpointer(tmp_path / "a", SMALL)
    sharer = Checkpointer(tmp_path / "b", share=owner)
    try:
        owner.save({"t": torch.ones(10)}, step=1).wait()
        import datastates.format.codec as fmt

        monkeypatch.setattr(
            fmt,
            "encode_index_items",
            lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")),
        )
        failing = sharer.save({"t": torch.randn(50_000)}, step=1)
        live = {"t": torch.zeros(10)}
        owner.restore(live)
        assert failing.done() and torch.equal(live["t"], torch.ones(10))
        monkeypatch.undo()
        with pytest.raises(datastates.CheckpointWriteError):
            failing.wait()
    finally:
        sharer.close()
        owner.close()


# ------------------------------------------------------------------ strict is all-or-nothing


def _assert_refused(tmp_path, saved: dict, live: dict, *fragments: str):
    """Save ``saved``, restore strictly into ``live``: StateMismatchError naming every fragment,
    and every live tensor and value bit for bit unchanged."""
    before = _snapshot(live)
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.save(saved, step=1).wait()
        with pytest.raises(StateMismatchError) as info:
            ck.restore(live)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert "Nothing was modified" in str(info.value)
    assert_same(_snapshot(live), before)
    return info.value


def test_adamw_state_into_sgd_with_momentum(tmp_path):
    live = _training(2, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    _assert_refused(tmp_path, _training(1), live, "opt", "AdamW", "SGD")


def test_adamw_state_into_a_fresh_sgd_without_state(tmp_path):
    model = _model(2)
    live = {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "extra": {"epoch": 0, "history": [0.5, 2.0], "t": torch.zeros(5)},
    }
    _assert_refused(tmp_path, _training(1), live, "opt", "AdamW", "SGD")


def test_more_param_groups_live_than_saved(tmp_path):
    """Saved with 1 group, live AdamW with 2: refused, model and extra['epoch'] unchanged."""
    model = _model(2)
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-4}], lr=1e-3
    )
    _step(model, opt)
    live = {
        "model": model,
        "opt": opt,
        "extra": {"epoch": 2, "history": [0.5, 2.0], "t": torch.zeros(5)},
    }
    _assert_refused(tmp_path, _training(1), live, "opt", "1 parameter group(s)", "live optimizer 2")


def test_fewer_params_in_a_group(tmp_path):
    model = _model(2)
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
    live = {
        "model": model,
        "opt": opt,
        "extra": {"epoch": 2, "history": [0.5, 2.0], "t": torch.zeros(5)},
    }
    _assert_refused(
        tmp_path, _training(1), live, "opt/param_groups/0", "4 parameters", "live optimizer 2"
    )


def test_per_parameter_state_names_differ(tmp_path):
    """Saved AdamW(amsgrad=True) has max_exp_avg_sq; a live AdamW that has state without it is
    refused (one without state yet accepts it, taking amsgrad from the checkpoint)."""
    saved = _training(1, lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True))
    live = _training(2)
    _assert_refused(tmp_path / "a", saved, live, "opt/state/0", "max_exp_avg_sq")
    model = _model(3)
    fresh = {
        "model": model,
        "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "extra": {"epoch": 0, "history": [0.0, 0.0], "t": torch.zeros(5)},
    }
    with Checkpointer(tmp_path / "b", SMALL) as ck:
        ck.save(saved, step=1).wait()
        ck.restore(fresh)
    assert fresh["opt"].param_groups[0]["amsgrad"] is True
    assert_same(_snapshot(fresh)["opt"], _snapshot(saved)["opt"])


def test_hyper_parameter_names_are_checked():
    """The provider's check itself: a hyper-parameter only one side has is refused, by name."""
    provider = datastates.OptimizerProvider()
    live = _training(1)["opt"]
    state = provider.state(_training(2)["opt"])
    provider.check(live, state, "opt")
    del state["param_groups"][0]["betas"]
    with pytest.raises(StateMismatchError, match=r"opt/param_groups/0.*'betas'"):
        provider.check(live, state, "opt")


def test_optimizer_class_is_saved_but_load_returns_the_plain_state_dict(tmp_path):
    state = _training(1)
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.save(state, step=1).wait()
        loaded = ck.load()["opt"]
    assert OPTIMIZER_CLASS_KEY not in loaded
    assert_same(loaded, state["opt"].state_dict())


@pytest.mark.parametrize(
    "saved_value, live_value, fragment",
    [
        (
            [torch.ones(2)],
            [torch.ones(2), torch.ones(2)],
            "extra/history (checkpoint 1 items, live 2; it holds tensors",
        ),
        (
            [1.0, 2.0],
            [torch.ones(2)],
            "extra/history (checkpoint 2 items, live 1; it holds tensors",
        ),
        ([1.0, 2.0], ["a"], "extra/history/0 (checkpoint float, live str)"),
        (3, "3", "extra/history (checkpoint int, live str)"),
        (3, 3.0, "extra/history (checkpoint int, live float)"),
        (True, 1, "extra/history (checkpoint bool, live int)"),
        (torch.ones(2), 1.0, "extra/history (checkpoint tensor, live float)"),
        (1.0, torch.ones(2), "extra/history (checkpoint float, live Tensor)"),
        ({"a": 1}, [1], "extra/history (checkpoint dict, live list)"),
        ({1, 2}, frozenset({1, 2}), "extra/history (checkpoint set, live frozenset)"),
        ({(1, 2): "a"}, [1], "extra/history (checkpoint dict, live list)"),
    ],
)
def test_structure_and_type_mismatches(tmp_path, saved_value, live_value, fragment):
    saved, live = _training(1), _training(2)
    saved["extra"]["history"], live["extra"]["history"] = saved_value, live_value
    _assert_refused(tmp_path, saved, live, fragment)


def test_a_live_none_accepts_any_saved_value(tmp_path):
    saved, live = _training(1), _training(2)
    saved["extra"]["best"], live["extra"]["best"] = 0.25, None
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.save(saved, step=1).wait()
        ck.restore(live)
    assert live["extra"]["best"] == 0.25
    assert_same(_snapshot(live), _snapshot(saved))


def test_non_strict_leaves_a_refused_optimizer_alone_and_restores_the_rest(tmp_path):
    saved = _training(1)
    live = _training(2, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    live["extra"]["history"] = [torch.full((1,), 9.0)]  # a tensor: the length must match
    opt_before = _snapshot(live)["opt"]
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.save(saved, step=1).wait()
        report = ck.restore(live, strict=False)
    assert [m.split(" ")[0] for m in report.mismatched] == ["opt", "extra/history"]
    assert "AdamW" in report.mismatched[0]
    assert not any(k.startswith("opt/") for k in report.restored)
    after = _snapshot(live)
    assert_same(after["opt"], opt_before)
    assert_same(after["model"], _snapshot(saved)["model"])
    assert torch.equal(after["extra"]["history"][0], torch.full((1,), 9.0))
    assert len(after["extra"]["history"]) == 1 and after["extra"]["epoch"] == 1


def test_checksum_failure_during_restore_leaves_values_and_provider_state_alone(tmp_path):
    """The documented behaviour of a corrupt region found while restoring in place: a typed
    error; tensors filled in place (model parameters, optimizer state tensors) may hold new
    values, but plain values and what providers apply (optimizer hyper-parameters, schedulers,
    RNG) are untouched: they change only after every read was verified. ``verify`` finds the
    damage first without touching live state."""
    saved = _training(1, lambda p: torch.optim.AdamW(p, lr=0.5))
    saved["sched"] = torch.optim.lr_scheduler.StepLR(saved["opt"], step_size=1, gamma=0.5)
    saved["sched"].step()
    with Checkpointer(tmp_path, SMALL) as ck:
        path = ck.save(saved, step=1).wait().path
    shard = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".dsf"))
    with open(shard, "r+b") as f:
        middle = os.path.getsize(shard) // 2  # inside the tensor data, far from header and index
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))
    live = _training(2)
    live["sched"] = torch.optim.lr_scheduler.StepLR(live["opt"], step_size=1, gamma=0.5)
    before = _snapshot(live)
    with Checkpointer(tmp_path, SMALL) as ck:
        with pytest.raises(datastates.CorruptCheckpointError, match="checksum"):
            _verify(ck)
        assert_same(_snapshot(live), before)
        with pytest.raises(datastates.CorruptCheckpointError, match="checksum"):
            ck.restore(live)
    after = _snapshot(live)
    assert_same(after["opt"]["param_groups"], before["opt"]["param_groups"])
    assert_same(after["sched"], before["sched"])
    assert after["extra"]["epoch"] == 2 and after["extra"]["history"] == [0.5, 2.0]


def _verify(ck) -> None:
    """What ``python -m datastates verify`` runs: every byte re-read, nothing live touched."""
    from datastates.restore.reader import Reader

    with Reader(ck.latest().path, registry=ck.registry) as reader:
        reader.verify_all()
