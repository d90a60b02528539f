"""What a trainer and a generation server (:mod:`polopt_lightning.serve`) say to each other: JSON requests over HTTP
for control (health, joining the weight group, a weight push's layout, generation), and the weights themselves over a
``torch.distributed`` group of the trainer's rank 0 and the servers (gloo on CPUs, NCCL on GPUs), in buckets of bytes.

Every request and every collective has a time limit: a server that dies or stops answering is an error naming it,
never a hang.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                     torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                     torch.bool)}


LORA_A, LORA_B = "lora_A::", "lora_B::"  # an adapter's tensors in a push, before the name of the weight they adapt


def gpu_id(device: torch.device) -> str | None:
    """The physical GPU behind ``device`` (its UUID), ``None`` off CUDA: NCCL cannot join two ranks on one GPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


class ServerError(RuntimeError):
    """A generation server failed, refused a request or did not answer in time (the message names it)."""


def base_url(address: str) -> str:
    """``host:port`` or a URL as ``http://host:port`` (no trailing slash)."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


def call(url: str, path: str, payload: dict[str, Any] | None = None, timeout: float = 60.0, name: str = "server"
         ) -> dict[str, Any]:
    """One request (``POST`` with ``payload``, ``GET`` without) and its JSON answer. A refused connection, a time-out
    or an error the server reports raises :class:`ServerError` naming ``name`` and ``url``."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if payload is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as err:  # the server answered with its own error
        try:
            reason = json.loads(err.read()).get("error", err.reason)
        except ValueError:
            reason = err.reason
        raise ServerError(f"{name} ({url}) failed {path}: {reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
        why = getattr(err, "reason", err)
        if isinstance(why, TimeoutError) or "timed out" in str(why):
            raise ServerError(f"{name} ({url}) did not answer {path} within {timeout:g} s: {type(why).__name__}: "
                              f"{why}") from None
        raise ServerError(f"{name} ({url}) could not be reached for {path} (not running, or it died): "
                          f"{type(why).__name__}: {why}") from None


def wait_for_health(url: str, timeout_s: float, name: str = "server", process: Any = None,
                    on_wait: Any = None) -> dict[str, Any]:
    """The server's ``/health`` answer, asked again every half second until it answers or ``timeout_s`` has passed
    (then :class:`ServerError`). ``process``: the server's own process, started for it: its exit ends the wait at once;
    ``on_wait()`` is called once, when the first ask goes unanswered."""
    deadline, waited = time.monotonic() + timeout_s, False
    while True:
        try:
            return call(url, "/health", None, min(10.0, timeout_s), name)
        except ServerError as err:
            if process is not None and process.poll() is not None:
                raise ServerError(f"{name} ({url}) exited with status {process.returncode} before it answered") from None
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            if time.monotonic() > deadline:
                raise ServerError(f"{err} (waited {timeout_s:g} s)") from None
            time.sleep(0.5)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now at ``host``."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tensor_layout(weights: dict[str, Tensor]) -> list[list[Any]]:
    """``[name, dtype, shape]`` of each weight, in the order they are sent."""
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in weights.items()]


def nbytes(entry: list[Any]) -> int:
    _, dtype, shape = entry
    count = 1
    for size in shape:
        count *= size
    return count * DTYPES[dtype].itemsize


def buckets(layout: list[list[Any]], bucket_bytes: int) -> list[list[int]]:
    """The layout's entries grouped in order into buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
    out: list[list[int]] = []
    size = bucket_bytes
    for i, entry in enumerate(layout):
        n = nbytes(entry)
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def pack(tensors: list[Tensor], device: torch.device | str = "cpu") -> Tensor:
    """Tensors as one flat byte buffer (any dtype: gloo has no bfloat16 of its own)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors])


def unpack(buffer: Tensor, entries: list[list[Any]]) -> dict[str, Tensor]:
    """The tensors :func:`pack` joined, by name, from their layout entries (views of ``buffer``; a copy where a
    tensor starts off its dtype's alignment, after byte tensors of odd sizes: a 4-bit base's)."""
    out, start = {}, 0
    for entry in entries:
        name, dtype, shape = entry
        n = nbytes(entry)
        chunk = buffer[start:start + n]
        if start % DTYPES[dtype].itemsize:
            chunk = chunk.clone()
        out[name] = chunk.view(DTYPES[dtype]).reshape(shape)
        start += n
    return out


def open_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> Any:
    """The weight group's store: the trainer's rank 0 hosts it (``is_master``; ``port`` 0 picks a free one, its
    ``.port`` says which), the servers connect to ``host:port``."""
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def weight_group(store: Any, rank: int, world_size: int, timeout_s: float, backend: str = "gloo",
                 prefix: str = "polopt") -> Any:
    """A process group of its own on ``store`` (outside ``torch.distributed``'s default one, which training may hold):
    rank 0 the trainer, the servers the others. It forms once every rank has joined, within ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def broadcast(group: Any, buffer: Tensor, timeout_s: float, refused: Any = None) -> None:
    """``buffer`` from rank 0 to every rank of ``group``, within ``timeout_s``; ``refused()`` (polled while it waits)
    returns an error to raise at once instead (a server that refused the push will not take part)."""
    timeout = timedelta(seconds=timeout_s)
    work = group.broadcast(buffer, 0, timeout)
    if refused is not None:
        deadline = time.monotonic() + timeout_s
        while not work.is_completed() and time.monotonic() < deadline:
            error = refused()
            if error is not None:
                raise error
            time.sleep(0.01)
    work.wait(timeout)
