"""``datastates keeper``: run a job's memory keeper in the foreground, or talk to a running one."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

from ..config import CheckpointConfig
from ..errors import ConfigError, KeeperError
from ..memory import keeper, place
from ..memory.options import STORAGE_FIELDS, MemoryTier


def _tier(args) -> MemoryTier:
    options = _json(args.options, "--options")
    changes = {
        k: v
        for k, v in (("root", args.root), ("idle_timeout_s", args.idle_timeout))
        if v is not None
    }
    if args.no_persist:
        changes["persist_on_exit"] = False
    try:
        return dataclasses.replace(MemoryTier(**options), **changes)
    except TypeError as exc:
        raise ConfigError(f"--options: {exc}") from None


def _config(args) -> CheckpointConfig:
    fields = _json(args.storage_config, "--storage-config")
    unknown = sorted(set(fields) - set(STORAGE_FIELDS))
    if unknown:
        raise ConfigError(
            f"--storage-config: unknown fields {unknown}; expected some of {list(STORAGE_FIELDS)}"
        )
    return CheckpointConfig(**fields)


def _json(text: str | None, flag: str) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object, found {text!r}")
    return value


def ask(memdir: str, op: str, timeout: float = 600.0) -> dict:
    """Send ``op`` to the keeper serving ``memdir`` on a connection of its own; its answer.
    KeeperError when no keeper serves it or it refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(place.socket_address(memdir))
        except OSError:
            raise KeeperError(f"no keeper serves {memdir}") from None
        data = b""
        try:
            sock.sendall(json.dumps({"op": op}).encode() + b"\n")
            while not data.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:  # it ended meanwhile, or does not answer within timeout
            raise KeeperError(f"the keeper of {memdir} did not answer {op!r}: {exc}") from None
        if not data.endswith(b"\n"):
            raise KeeperError(f"the keeper of {memdir} ended before answering {op!r}")
    finally:
        sock.close()
    reply = json.loads(data)
    if not reply.get("ok"):
        raise KeeperError(f"the keeper of {memdir} refused {op!r}: {reply.get('error')}")
    return reply


def run_command(args) -> int:
    tier = _tier(args)
    memdir = place.memory_dir(tier.root, args.path)
    for op in ("status", "persist", "stop"):
        if getattr(args, op):
            try:
                reply = ask(memdir, op)
            except KeeperError:
                if op != "stop" or not os.path.isdir(memdir) or place.keeper_running(memdir):
                    raise
                # No keeper: what a killed one left (the memory, its lock) is removed here.
                reply = keeper.Keeper(args.path, tier, _config(args)).remove_left()
            print(json.dumps(reply, indent=2))
            return 0
    return keeper.main(
        args.path, tier, _config(args), tier.log_path or place.default_log(args.path)
    )
