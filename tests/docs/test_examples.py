"""Every shipped example runs: the ```python blocks of README.md and docs/ (every page of the
site), and the example in the package docstring.

Each block runs in a process of its own (forked from a zygote of the session, tests/zygote.py,
started with the examples' environment: torch is already imported), in an empty directory, after a
*prelude* that defines the names the examples assume and import nothing of the example's own:

- plain PyTorch (any block): ``model`` (a tiny GPT of ``benchmarks.gpt`` whose
  ``model(x, y)`` returns the loss), ``opt`` (AdamW), ``sched`` (StepLR), ``loader`` (a stateful
  batch source: ``loader.next()`` gives ``(x, y)``), ``epoch = 0``, ``total_steps = 250``;
- DeepSpeed blocks: a single-process gloo setup on the CPU (``DS_ACCELERATOR=cpu``, the
  ``MASTER_*``/``RANK`` variables, ``deepspeed.init_distributed``), ``model`` (an MLP), ``save_dir``;
- Lightning blocks: ``model``, a tiny ``LightningModule`` with its own data;
- Hugging Face blocks: ``model`` (a 2-layer GPT-2 built from a config, no download), ``ds`` (a
  list of ``{"input_ids", "labels"}``);
- ``torch.distributed.checkpoint`` blocks: ``state_dict`` (a dict of tensors);
- blocks naming an ``s3://`` location also get the standard AWS variables pointing at the suite's
  own S3-compatible server (tests/s3/server.py), whose bucket is ``ckpt``.

A block that resumes (it calls ``.latest()`` or ``.latest_checkpoint()``) runs twice in the same
directory: the second run must resume from what the first one saved. After each block a *check*
(``CHECKS``, picked by a phrase of the block) asserts on what the example saved or loaded: a
resumed plain loop ends bit-identical to the uninterrupted first run; a saved checkpoint read back
by a fresh reader holds exactly the live tensors; a framework's load found its checkpoint. A block
is skipped only when a framework it imports is not installed.

A block that cannot run alone (it needs ``torchrun``, a real signal, a module of the reader's own)
starts with the line ``# not run: <reason>``: it is compiled, not run, and such blocks stay few.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import textwrap

import pytest

import datastates
import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
TIMEOUT_S = 600

PLAIN = """
import torch
from benchmarks.gpt import GPT, GPTConfig, synthetic_batch

torch.manual_seed(0)
_CFG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)


class Loader:
    def __init__(self):
        self.position = 0

    def next(self):
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        return synthetic_batch(_CFG, 4, g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


model = GPT(_CFG)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
loader = Loader()
epoch = 0
total_steps = 250
"""

DEEPSPEED = """
import os
import socket
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    _port = _s.getsockname()[1]
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port),
                  RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import deepspeed
import torch
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
save_dir = "ds_ckpts"
"""

LIGHTNING = """
import torch
import lightning.pytorch as pl


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g),
                                              torch.randn(16, 2, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


torch.manual_seed(0)
model = _Tiny()
"""

HF = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
_ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
ds = [{"input_ids": x, "labels": x} for x in _ids]
"""

DCP = """
import torch
torch.manual_seed(0)
state_dict = {"weight": torch.randn(64, 32), "bias": torch.randn(32), "step": torch.tensor(3)}
"""

# What each example must have done, appended after it. ``_RUN`` is 1 or 2 (resuming blocks run
# twice); a check may write ``result-<run>.json`` for the test to compare the runs.
_DIGEST = """
import hashlib as _hl, json as _json
def _digest(*trees):
    h = _hl.sha256()
    for tree in trees:
        for k, v in sorted(tree.items(), key=lambda kv: str(kv[0])):
            h.update(str(k).encode())
            if isinstance(v, dict):
                h.update(_digest(v).encode())
            elif isinstance(v, torch.Tensor):
                h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()
"""

_SAME_AS_SAVED = (
    _DIGEST
    + """
import datastates as _ds
_saved = _ds.Checkpointer({root!r}).load({which})["model"]
_live = model.state_dict()
assert _saved.keys() == _live.keys(), (sorted(_saved), sorted(_live))
assert all(torch.equal(_saved[k], _live[k]) for k in _live), "the checkpoint differs from the model"
"""
)

_RESUMED = (
    _DIGEST
    + """
with open(f"result-{_RUN}.json", "w") as _f:
    _json.dump({"start": start, "position": loader.state_dict(),
                "digest": _digest(model.state_dict(), opt.state_dict())}, _f)
"""
)

CHECKS = [
    # the memory tier's loop: resumed as below, from memory (the first run's keeper still
    # holds it); the second run then ends the keeper, whose memory must be gone
    (
        "memory_tier=tier",
        _RESUMED
        + """
import os as _os
from datastates.memory import place as _place
_memdir = _place.memory_dir(tier.root, "ckpts")
if _RUN == 2:
    assert _os.path.isdir(_memdir), "the first run's keeper kept no memory"
    with datastates.Checkpointer("ckpts", config) as _again:
        assert _again.restore(state).tier == "memory"
        _again.close(stop_keeper=True)
    import time as _time
    _deadline = _time.monotonic() + 60
    while _os.path.exists(_memdir) and _time.monotonic() < _deadline:
        _time.sleep(0.05)  # the keeper removes it as it ends, in its own process
    assert not _os.path.exists(_memdir), "the stopped keeper left its memory behind"
""",
    ),
    # the resume loops: the second run starts after the newest checkpoint and ends bit-identical
    ("start = ckpt.restore(state", _RESUMED),
    # docs/data.md: a resumed run goes on from the saved step (a restart from step 0 would save
    # step 10 again: CheckpointExistsError) and ends after the same number of batches
    (
        "for epoch in range(loader.epoch, epochs)",
        """
assert step == 64, step
assert [i.step for i in datastates.Checkpointer("ckpts").list()] == [10, 20, 30, 40, 50, 60]
""",
    ),
    (
        "s3://ckpt/runs/gpt-small",
        _SAME_AS_SAVED.format(root="s3://ckpt/runs/gpt-small", which="step=100"),
    ),
    ('datastates.Checkpointer("ckpts")', _SAME_AS_SAVED.format(root="ckpts", which="step=10")),
    (
        "engine.save_checkpoint(save_dir)",
        """
assert load_path is not None, "load_checkpoint found no checkpoint"
assert load_path.startswith(save_dir), load_path
""",
    ),
    (
        "DatastatesCheckpointIO",
        """
_loaded = DatastatesCheckpointIO().load_checkpoint("ckpts/last.ckpt")
assert _loaded["epoch"] == 2, _loaded["epoch"]
_live = model.state_dict()
assert all(torch.equal(_loaded["state_dict"][k], _live[k]) for k in _live)
""",
    ),
    (
        "DatastatesTrainer",
        """
assert trainer.latest_checkpoint().endswith("checkpoint-6"), trainer.latest_checkpoint()
assert trainer.state.global_step == 6, trainer.state.global_step
""",
    ),
    (
        "DatastatesReader",
        """
_fresh = {k: torch.zeros_like(v) for k, v in state_dict.items()}
dcp.load(_fresh, storage_reader=DatastatesReader("ckpt/step-100"))
assert all(torch.equal(_fresh[k], state_dict[k]) for k in state_dict)
""",
    ),
]
#: Blocks that define code for the reader to fill in and load nothing: they must only run.
DEFINES_ONLY = ("class TestMyProvider(ProviderConformance)", "class TestMyStore(StoreConformance)")


def _check(code: str) -> str:
    for phrase, check in CHECKS:
        if phrase in code:
            return check
    assert any(phrase in code for phrase in DEFINES_ONLY), "an example with no check of its result"
    return ""


# (module whose import marks a block, prelude, modules that must be installed)
FRAMEWORKS = [
    ("deepspeed", DEEPSPEED, ("deepspeed",)),
    ("lightning", LIGHTNING, ("lightning",)),
    ("transformers", HF, ("transformers", "accelerate")),
    ("torch.distributed.checkpoint", DCP, ()),
]


#: The first line of a block that is compiled but not run, followed by the reason.
NOT_RUN = "# not run:"
#: At most this many such blocks in all the pages.
MAX_NOT_RUN = 8


def _markdown_files():
    files = [os.path.join(ROOT, "README.md")]
    for folder, _, names in sorted(os.walk(os.path.join(ROOT, "docs"))):
        files += sorted(os.path.join(folder, n) for n in names if n.endswith(".md"))
    return files


def _python_blocks(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        line = text.count("\n", 0, m.start()) + 1
        yield f"{os.path.relpath(path, ROOT)}:{line}", m.group(1)


def _blocks_of_markdown(path: str):
    for where, code in _python_blocks(path):
        if not code.startswith(NOT_RUN):
            yield where, code


def _block_of_docstring():
    doc = datastates.__doc__
    body = doc.split("::\n", 1)[1]
    return "datastates.__doc__", textwrap.dedent(body)


def _examples():
    for path in _markdown_files():
        yield from _blocks_of_markdown(path)
    yield _block_of_docstring()


EXAMPLES = list(_examples())
NOT_RUN_BLOCKS = [
    (where, code)
    for path in _markdown_files()
    for where, code in _python_blocks(path)
    if code.startswith(NOT_RUN)
]


def _imports(code: str, module: str) -> bool:
    return re.search(rf"^\s*(import|from)\s+{re.escape(module)}\b", code, re.M) is not None


def _prelude(code: str) -> str:
    for module, prelude, required in FRAMEWORKS:
        if _imports(code, module):
            missing = [m for m in required if importlib.util.find_spec(m) is None]
            if missing:
                pytest.skip(f"{', '.join(missing)} not installed")
            return prelude
    return PLAIN


def test_every_document_has_its_examples_collected():
    names = {where.split(":")[0] for where, _ in EXAMPLES}
    assert {
        "README.md",
        "docs/index.md",
        "docs/deepspeed.md",
        "docs/lightning.md",
        "docs/huggingface.md",
        "docs/dcp.md",
        "docs/data.md",
        "docs/storage.md",
        "datastates.__doc__",
    } <= names, sorted(names)


def test_blocks_that_are_not_run_are_few_compile_and_say_why():
    assert 0 < len(NOT_RUN_BLOCKS) <= MAX_NOT_RUN, [w for w, _ in NOT_RUN_BLOCKS]
    for where, code in NOT_RUN_BLOCKS:
        reason = code.split("\n", 1)[0][len(NOT_RUN) :].strip()
        assert len(reason) >= 10, f"{where}: say why the block is not run"
        compile(code, where, "exec")  # a SyntaxError names the block


@pytest.mark.parametrize("where, code", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_example_runs(where, code, tmp_path, request):
    script = tmp_path / "example.py"
    body = _prelude(code) + "\n# ---- the example: " + where + "\n" + code
    check = _check(code)
    env = dict(
        os.environ,
        PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    if "s3://" in code:  # object-storage examples run against the suite's own S3 server
        server = request.getfixturevalue("s3_server")
        env.update(
            AWS_ENDPOINT_URL=server.endpoint,
            AWS_ACCESS_KEY_ID=server.access_key,
            AWS_SECRET_ACCESS_KEY=server.secret_key,
            AWS_DEFAULT_REGION=server.region,
        )
    runs = 2 if (".latest()" in code or ".latest_checkpoint()" in code) else 1
    for run in range(1, runs + 1):
        script.write_text(f"{body}\n# ---- its check\n_RUN = {run}\n{check}")
        proc = zygote.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, (
            f"{where} (run {run} of {runs}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    if (tmp_path / "result-2.json").exists():  # a resumed loop: same end as the first run
        first, second = (json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (1, 2))
        assert first["start"] == 0 and second["start"] > 0, (first, second)
        assert second["position"] == first["position"], (first, second)
        assert second["digest"] == first["digest"], "the resumed run ended with other weights"
