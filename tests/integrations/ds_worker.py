"""Runs a real DeepSpeed engine on the CPU (one process, gloo) for test_deepspeed.py.

Usage: python ds_worker.py OUT_DIR MODE   where MODE is
  "zero1-lazy"  : ZeRO-1 + bf16, datastates engine, enable_lazy_snapshots()
  "zero2-lazy"  : the same with ZeRO-2
  "fp32-default": no ZeRO, fp32, a BatchNorm buffer, datastates engine without the step guard
  "latest"      : as "fp32-default", checking when `latest` is written (latest_scenario)
Writes OUT_DIR/result.json; any assertion failure exits non-zero with a traceback.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import torch  # noqa: E402

STEPS_BEFORE, STEPS_AFTER = 3, 3
ZERO = {"zero1-lazy": 1, "zero2-lazy": 2}  # mode -> ZeRO stage


def model_for(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU()]
    if mode == "fp32-default":
        layers.append(torch.nn.BatchNorm1d(32))
    layers.append(torch.nn.Linear(32, 8))
    return torch.nn.Sequential(*layers)


def config_for(mode: str, datastates: bool) -> dict:
    cfg = {
        "train_batch_size": 4,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    if mode in ZERO:
        cfg["zero_optimization"] = {"stage": ZERO[mode]}
        cfg["bf16"] = {"enabled": True}
    if datastates:
        cfg["datastates_ckpt"] = {"host_cache_size": 0.01, "writer_threads": 1}
    return cfg


def batch(step: int, mode: str):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(4, 16, generator=g)
    return x.bfloat16() if mode in ZERO else x


def make_engine(mode: str, datastates: bool):
    import deepspeed

    model = model_for(mode)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config_for(mode, datastates)
    )
    return engine


def train(engine, mode: str, steps: range) -> None:
    for step in steps:
        loss = engine(batch(step, mode)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()


def fp32_masters(engine) -> dict:
    """The fp32 master weights of the ZeRO optimizer, by parameter name."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name: safe_get_full_fp32_param(p).detach().clone()
        for name, p in engine.module.named_parameters()
    }


def same_fp32(got: dict, want: dict) -> dict:
    """Per parameter name: whether ``got`` holds it as float32, bit-identical to ``want``."""
    return {
        k: k in got and got[k].dtype == torch.float32 and torch.equal(got[k], v)
        for k, v in want.items()
    }


def params(engine) -> dict:
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def read_latest(save_dir: str):
    path = os.path.join(save_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def latest_scenario(out: str) -> dict:
    """Default mode, no wait and no destroy: once the tag's files are committed and training
    took a step, `latest` names it, and a copy of the folder then (what a crash leaves) resumes
    bit-exact. save_checkpoint(save_latest=False) leaves `latest` alone, a later one moves it."""
    import shutil

    import deepspeed
    from datastates.integrations.deepspeed import wait_for_checkpoints

    mode = "fp32-default"
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    ds_dir, crash_dir = os.path.join(out, "ds"), os.path.join(out, "crash")
    ref = make_engine(mode, datastates=False)
    train(ref, mode, range(STEPS_BEFORE + STEPS_AFTER))
    continuous = params(ref)
    ref.destroy()

    eng = make_engine(mode, datastates=True)
    ours = eng.checkpoint_engine.ckpt_engine
    handles, path_save = [], ours._paths.save

    def recording_save(state, path, **kwargs):  # the SaveHandle of each file
        handles.append(path_save(state, path, **kwargs))
        return handles[-1]

    ours._paths.save = recording_save
    train(eng, mode, range(STEPS_BEFORE))
    eng.save_checkpoint(ds_dir)
    result = {"files_saved": len(handles)}
    train(eng, mode, range(STEPS_BEFORE, STEPS_BEFORE + 1))
    for handle in handles:
        handle.wait()  # committed (the public SaveHandle API); no wait() of the engine
    train(eng, mode, range(STEPS_BEFORE + 1, STEPS_BEFORE + 2))
    result["latest_after_commit"] = read_latest(ds_dir)
    shutil.copytree(ds_dir, crash_dir)  # what a crash now would leave on disk

    eng.save_checkpoint(ds_dir, tag="eval_snapshot", save_latest=False)
    train(eng, mode, range(STEPS_BEFORE + 2, STEPS_BEFORE + 3))
    wait_for_checkpoints(eng)
    result["latest_after_save_latest_false"] = read_latest(ds_dir)
    snapshot_dir = os.path.join(ds_dir, "eval_snapshot")
    result["eval_snapshot_files"] = sorted(n for n in os.listdir(snapshot_dir) if n.endswith(".pt"))
    eng.save_checkpoint(ds_dir, tag="final")
    eng.destroy()
    result["latest_after_final"] = read_latest(ds_dir)

    resume_into(result, mode, crash_dir, continuous)
    return result


def resume_into(result: dict, mode: str, save_dir: str, continuous: dict) -> None:
    """Resume a fresh engine from ``save_dir``'s ``latest`` and train on: whether it loaded,
    at which step, and whether it ends bit-exact with the continuous run (into ``result``)."""
    eng2 = make_engine(mode, datastates=True)
    load_path, _ = eng2.load_checkpoint(save_dir)
    result["loaded"] = load_path is not None
    result["global_steps"] = eng2.global_steps
    train(eng2, mode, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    result["resumed_bit_exact"] = {
        k: bool(torch.equal(a, continuous[k])) for k, a in params(eng2).items()
    }
    eng2.destroy()


def main(out: str, mode: str) -> None:
    import deepspeed
    from datastates.integrations.deepspeed import (
        CheckpointEngine,
        enable_lazy_snapshots,
        export_torch_files,
    )

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    ds_dir, torch_dir = os.path.join(out, "ds"), os.path.join(out, "torch")
    result = {"mode": mode}

    # 1. The reference: DeepSpeed's own torch.save engine, same trajectory, same save point.
    ref = make_engine(mode, datastates=False)
    train(ref, mode, range(STEPS_BEFORE))
    ref.save_checkpoint(torch_dir)
    train(ref, mode, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    continuous = params(ref)
    ref.destroy()

    # 2. datastates: save, keep training at once (the step must not corrupt the capture).
    eng = make_engine(mode, datastates=True)
    ours = eng.checkpoint_engine.ckpt_engine
    assert isinstance(ours, CheckpointEngine), type(ours)
    if mode in ZERO:
        enable_lazy_snapshots(eng)
    lazy_bytes, path_save = {}, ours._paths.save

    def recording_save(state, path, **kwargs):  # which bytes the capture rule made lazy
        handle = path_save(state, path, **kwargs)
        lazy_bytes[os.path.basename(str(path))] = handle.stats.lazy_nbytes
        return handle

    ours._paths.save = recording_save
    train(eng, mode, range(STEPS_BEFORE))
    eng.save_checkpoint(ds_dir)
    masters = fp32_masters(eng) if mode in ZERO else {}  # the optimizer's, at the save
    result["lazy_bytes"] = lazy_bytes
    result["trainable_bytes"] = sum(
        p.numel() * p.element_size() for p in eng.module.parameters() if p.requires_grad
    )
    train(eng, mode, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    result["same_trajectory"] = all(torch.equal(a, continuous[k]) for k, a in params(eng).items())
    eng.destroy()  # DataStatesCheckpointEngine.cleanup() -> wait(persist=True)

    tag = "global_step%d" % STEPS_BEFORE
    with open(os.path.join(ds_dir, "latest")) as f:
        result["latest"] = f.read()
    result["files"] = sorted(os.listdir(os.path.join(ds_dir, tag)))
    result["torch_files"] = sorted(os.listdir(os.path.join(torch_dir, tag)))  # stock DeepSpeed's
    # Each file DeepSpeed named is a file (the shard of .datastates/<file>/, linked in place).
    result["files_are_checkpoints"] = all(
        os.path.isfile(os.path.join(ds_dir, tag, n))
        and os.path.isfile(os.path.join(ds_dir, tag, ".datastates", n, "manifest.json"))
        for n in result["files"]
        if n.endswith(".pt")
    )
    if mode in ZERO:  # DeepSpeed's own consolidation reads the tag folder as it is
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(ds_dir, tag)
        result["zero_to_fp32_in_place"] = same_fp32(fp32, masters)
        # The script DeepSpeed copied into the save folder, run as a user runs it (the tag
        # from `latest`): it writes pytorch_model.bin.
        import subprocess

        script, fp32_dir = os.path.join(ds_dir, "zero_to_fp32.py"), os.path.join(out, "fp32")
        subprocess.run([sys.executable, script, ds_dir, fp32_dir], check=True)
        written = torch.load(os.path.join(fp32_dir, "pytorch_model.bin"), weights_only=True)
        result["recovery_script_in_place"] = same_fp32(written, masters)

    # 3. load() returns what torch.load returned for the same file.
    reader = CheckpointEngine({"host_cache_size": 0.01})
    mismatches = []
    for name in sorted(os.listdir(os.path.join(torch_dir, tag))):
        want = torch.load(
            os.path.join(torch_dir, tag, name), map_location="cpu", weights_only=False
        )
        got = reader.load(os.path.join(ds_dir, tag, name), map_location=lambda s, loc: s)
        compare(want, got, name, mismatches)
    reader.close()
    result["torch_equivalent_mismatches"] = mismatches[:20]

    # 3b. The documented route to DeepSpeed's offline tools: export, then zero_to_fp32 without
    # --tag gives the same fp32 weights as from DeepSpeed's own files.
    exported = export_torch_files(os.path.join(ds_dir, tag))
    result["exported"] = sorted(os.path.basename(p) for p in exported)
    if mode in ZERO:  # zero_to_fp32 reads ZeRO checkpoints only
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        want = get_fp32_state_dict_from_zero_checkpoint(torch_dir)
        got = get_fp32_state_dict_from_zero_checkpoint(ds_dir + "-torch")
        result["zero_to_fp32_same"] = list(want) == list(got) and all(
            torch.equal(want[k], got[k]) for k in want
        )

    # 4. Resume in a fresh engine from `latest` and continue: bit-exact with the continuous run.
    resume_into(result, mode, ds_dir, continuous)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


_SKIP_KEYS = {"ds_config"}  # holds the datastates_ckpt key in one run and not in the other


def compare(a, b, path: str, out: list) -> None:
    if type(a) is not type(b):
        out.append(f"{path}: type {type(a).__name__} != {type(b).__name__}")
    elif isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            out.append(f"{path}: tensor differs")
    elif isinstance(a, dict):
        if list(a) != list(b):
            out.append(f"{path}: keys {list(a)} != {list(b)}")
        for k in a:
            if k in b and k not in _SKIP_KEYS:
                compare(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{path}[{i}]", out)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        compare(vars(a), vars(b), f"{path}.__dict__", out)
    elif a != b:
        out.append(f"{path}: {a!r} != {b!r}")


if __name__ == "__main__":
    if sys.argv[2] == "latest":
        with open(os.path.join(sys.argv[1], "result.json"), "w") as f:
            json.dump(latest_scenario(sys.argv[1]), f)
    else:
        main(sys.argv[1], sys.argv[2])
