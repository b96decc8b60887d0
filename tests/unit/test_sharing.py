"""Checkpointers sharing one pipeline (``Checkpointer(share=...)``): closing the owner while a
sharer's ``save()`` is still planning leaves nothing waiting for that save."""

from __future__ import annotations

import threading

import torch
from torch import nn

from datastates import Checkpointer, CheckpointerClosedError
from datastates.providers import ProviderRegistry
from datastates.providers.base import StateProvider
from testkit import MEDIUM


class Gate:
    """An object whose state is handed out only once ``release`` is set: it holds ``save()``
    in its planning for as long as the test wants."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()


class GateProvider(StateProvider):
    name = "tests.Gate"

    def can_handle(self, obj):
        return isinstance(obj, Gate)

    def state(self, obj):
        obj.entered.set()
        assert obj.release.wait(60), "the test never released the gate"
        return {"open": True}

    def load(self, obj, state):
        pass


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_owner_closed_while_a_sharer_plans_leaves_nothing_waiting(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    owner = Checkpointer(tmp_path / "owner", MEDIUM)
    sharer = Checkpointer(
        tmp_path / "sharer",
        share=owner,
        registry=ProviderRegistry.default().register(GateProvider()),
    )
    assert sharer.save({"model": model, "opt": opt}, step=1).wait().name == "step-0000000001"
    gate, outcome = Gate(), {}

    def save():
        try:
            outcome["handle"] = sharer.save({"model": model, "opt": opt, "gate": gate}, step=2)
        except CheckpointerClosedError as exc:
            outcome["error"] = exc

    saving = _in_thread(save)
    assert gate.entered.wait(60)  # save() is planning
    owner.close()
    gate.release.set()
    saving.join(60)
    assert not saving.is_alive()
    assert isinstance(outcome.get("error"), CheckpointerClosedError), outcome
    # the guarded step runs (nothing waits for the refused save) and changes the parameters
    before = model.weight.detach().clone()
    model(torch.ones(2, 8)).sum().backward()
    stepping = _in_thread(opt.step)
    stepping.join(60)
    assert not stepping.is_alive(), "opt.step() waits for a save that will never be captured"
    assert not torch.equal(model.weight, before)
    closing = _in_thread(sharer.close)
    closing.join(60)
    assert not closing.is_alive(), "sharer.close() waits for a save that will never finish"
    # only the first save was committed; the refused one left nothing behind
    with Checkpointer(tmp_path / "sharer") as reader:
        assert [i.name for i in reader.list()] == ["step-0000000001"]
    assert sorted(p.name for p in (tmp_path / "sharer").iterdir()) == ["latest", "step-0000000001"]
