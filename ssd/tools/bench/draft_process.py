"""A second process that hosts SSD's draft side over the host link, without Ray.

The parent (rank 0 of every link) starts it with multiprocessing's spawn
(CUDA cannot be forked) and drives it over a control link (ssd.transport.distributed, gloo
over 127.0.0.1):
- ECHO: sent back as is (the link's round-trip time);
- SERVE(model spec, prefix): build the random model the spec names (once per
  spec), answer READY with its fingerprint, join a new link under `prefix`
  and serve SSD's draft side on it until the target shuts it down: the one
  draft-side host (ssd.saguaro.host.serve_link) the cluster's DraftWorker runs;
- STOP: close and exit.
A failure while serving is answered with ERROR, so the parent never waits
for a draft that is gone.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import sys
import time
import traceback
from typing import Any

import torch

from ssd.models.shapes import RandomModelSpec, build_random_model, fingerprint
from ssd.transport.channel import ChannelClosed, Message
from ssd.saguaro.host import serve_link
from ssd.transport.distributed import DistributedChannel, free_port, serve_store

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
ECHO, SERVE, READY, ERROR, STOP = "echo", "serve", "ready", "error", "stop"
CONTROL_PREFIX = "draft-host-control"


def exact_fp32() -> None:
    """fp32 matmuls in full fp32: TF32 would round both roles' logits to 10-bit mantissas."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class DraftProcess:
    """The parent's handle on the second process (a context manager)."""

    def __init__(self, device: str, timeout_s: float = 120.0, threads: int | None = None) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.port = free_port()
        serve_store(HOST, self.port, timeout_s)  # listening before the process tries to join
        self._links = itertools.count()
        context = multiprocessing.get_context("spawn")
        self._started = context.Event()
        level = logging.getLogger().getEffectiveLevel()
        self._process = context.Process(
            target=host_main, args=(self.port, device, timeout_s, threads, level, self._started),
            name="draft-host", daemon=True,
        )
        self._process.start()
        self._control: DistributedChannel | None = None
        self._failed: BaseException | None = None  # once the process is lost, every call fails at once

    def connect(self) -> None:
        """Wait for the process to import and join the control link (seconds: torch and transformers)."""
        if self._control is not None:
            return
        self._check()
        try:
            self._wait_started()
            self._control = DistributedChannel.connect(
                HOST, self.port, rank=0, prefix=CONTROL_PREFIX, timeout_s=self.timeout_s
            )
        except Exception as exc:
            self._failed = exc
            raise

    def speculate(self, spec: RandomModelSpec) -> tuple[DistributedChannel, float]:
        """A new link to a Speculator over the model `spec` names, and that model's fingerprint."""
        prefix = f"draft-host-ssd-{next(self._links)}"  # rank 0 refuses a prefix used before on its port
        reply = self._request(Message(SERVE, {"model": _spec_dict(spec), "prefix": prefix}))
        channel = DistributedChannel.connect(HOST, self.port, rank=0, prefix=prefix, timeout_s=self.timeout_s)
        return channel, reply.header["fingerprint"]

    def echo(self, message: Message) -> Message:
        return self._request(Message(ECHO, message.header, message.tensors))

    def close(self) -> None:
        if self._control is not None:
            try:
                self._control.send(Message(STOP))
            except ChannelClosed as exc:  # the process is gone already; the join below confirms it
                log.warning("draft host link was down at close: %s", exc)
            self._control.close()
            self._control = None
        self._process.join(self.timeout_s)
        if self._process.is_alive():  # ours, and wedged: nothing else will end it
            log.warning("draft host did not exit; terminating it")
            self._process.terminate()
            self._process.join(5)

    def __enter__(self) -> "DraftProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, message: Message) -> Message:
        self.connect()
        self._control.send(message)
        reply = self._control.recv(self.timeout_s)
        if reply.op == ERROR:
            raise RuntimeError(f"draft host failed: {reply.header['error']}")
        return reply

    def _check(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"draft host unavailable: {self._failed}") from self._failed
        if not self._process.is_alive():
            raise RuntimeError(f"draft host exited with status {self._process.exitcode}")

    def _wait_started(self) -> None:
        """Until the process runs our code; fails fast if it died importing (say, a missing package)."""
        deadline = time.monotonic() + self.timeout_s
        while not self._started.wait(0.5):
            self._check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"draft host did not start within {self.timeout_s} s")


def _spec_dict(spec: RandomModelSpec) -> dict[str, Any]:
    return {"config": spec.config, "seed": spec.seed, "noise": spec.noise,
            "noise_seed": spec.noise_seed, "dtype": spec.dtype}


# --- the second process --------------------------------------------------------


def host_main(port: int, device: str, timeout_s: float, threads: int | None, log_level: int,
              started: Any) -> None:
    """Entry point of the spawned process (`started`: an Event set just before it joins the control link)."""
    logging.basicConfig(level=log_level, format="%(asctime)s draft-host %(name)s: %(message)s")
    code = 0
    try:
        _host_loop(port, device, timeout_s, threads, started)
    except BaseException:  # noqa: BLE001 - printed here; the exit status tells the parent
        traceback.print_exc()
        code = 1
    # Skip the interpreter's teardown: with torch and transformers loaded it
    # takes seconds (measured: 6 s on a busy 2-core host), and nothing here needs it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _host_loop(port: int, device: str, timeout_s: float, threads: int | None, started: Any) -> None:
    if threads:
        torch.set_num_threads(threads)
    exact_fp32()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)
    started.set()
    control = DistributedChannel.connect(HOST, port, rank=1, prefix=CONTROL_PREFIX, timeout_s=timeout_s)
    models: dict[str, torch.nn.Module] = {}
    try:
        while (msg := control.recv()).op != STOP:
            if msg.op == ECHO:
                control.send(msg)
            elif msg.op == SERVE:
                _serve(control, msg, models, port, device, timeout_s)
    finally:
        control.close()


def _serve(control: DistributedChannel, msg: Message, models: dict[str, torch.nn.Module],
           port: int, device: str, timeout_s: float) -> None:
    try:
        spec = RandomModelSpec(**msg.header["model"])
        if spec.key() not in models:
            models[spec.key()] = build_random_model(spec, device)
        model = models[spec.key()]
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        log.exception("building the draft failed")
        control.send(Message(ERROR, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))
        return
    control.send(Message(READY, {"fingerprint": fingerprint(model)}))
    serve_link(model, port, msg.header["prefix"], timeout_s, host=HOST)
