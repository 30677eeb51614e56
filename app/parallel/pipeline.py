"""Pipeline parallelism: run a schedule of forward/backward passes over the pp axis.

Each stage runs the actions of `app/parallel/schedule.py` in order. A forward pass of
chunk c receives its input activation from the stage of chunk c - 1 (the first chunk
embeds tokens), runs the chunk, and sends its output to the stage of chunk c + 1 (the
last chunk computes the loss instead). A backward pass receives the output gradient from
chunk c + 1 (the last chunk starts from its loss), back-propagates, and sends the input
gradient to chunk c - 1. Receives are posted non-blocking and waited for when the pass
needs them — with `parallel.overlap_pp_comm`, the next action's receive is posted before the
current action computes, so the transfer overlaps that compute.

Sends are non-blocking, and each holds its buffer (a forward's output, a backward's input
gradient) until it is known delivered: when this stage receives a message that the peer sent
only after receiving it (`schedule.send_proofs`), or when its work reports completion (NCCL;
gloo's p2p work never does before its wait). Waiting on a send earlier could block on a peer
that first waits for this stage. The rest are waited for at the end of the step, so a stage
holds a bounded number of messages (`schedule.held_sends`: about the forwards in flight),
not every message of the step.

p2p messages are matched first-in first-out per (source, destination, group), on NCCL as
on Gloo (NCCL ignores tags); `schedule.simulate` checks that every schedule receives each
stream in the order it sends it. Activations and gradients travel on separate groups, and
the wrap-around messages of the interleaved schedule (last stage -> first stage forward,
first -> last backward) on two more, so that within each group messages only flow one way
along the stages: on NCCL, where a group's operations queue on one stream and a large
send waits for its receive, that leaves no cycle of sends waiting on each other.

Tied embeddings: the first stage's embedding and the last stage's head copy get the sum of
their gradients over `tied_group` (done by `DataParallel` after the dp reduction), so the
two copies stay equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist

from app.model.gpt import GPT, Targets
from app.parallel.schedule import Action, Message, build_schedule, messages, send_proofs
from app.runtime.grid import ProcessGrid
from app.runtime.timers import StepTimers, comm_region, launch, wait


class Sends:
    """This stage's sends of one step that are not yet known delivered: each holds its work and
    its buffer (which must live until the transfer is done)."""

    def __init__(self, timers: Optional[StepTimers], proofs: dict[Message, tuple[Message, ...]]) -> None:
        self.timers, self.proofs = timers, proofs
        self.held: dict[Message, tuple[Any, torch.Tensor, int]] = {}  # message -> (work, buffer, destination)

    def add(self, message: Message, work: Any, buffer: torch.Tensor, dst_stage: int) -> None:
        self.held[message] = (work, buffer, dst_stage)

    def received(self, message: Message) -> None:
        """`message` arrived: the sends it proves delivered are waited for (at once) and dropped."""
        self.drop(m for m in self.proofs.get(message, ()) if m in self.held)

    def poll(self) -> None:
        """Drop the sends whose work says it completed (NCCL; gloo's p2p work never does unwaited)."""
        self.drop([m for m, (work, _, _) in self.held.items() if work.is_completed()])

    def drop(self, done: Iterable[Message]) -> None:
        for message in list(done):
            work, _, dst = self.held.pop(message)
            with comm_region(self.timers, "pp", f"wait for isend to stage {dst}"):
                work.wait()

    def wait_all(self) -> None:
        if self.held:
            with comm_region(self.timers, "pp", "wait for isends"):
                for work, _, _ in self.held.values():
                    work.wait()
            self.held.clear()


class Pipeline:
    """This stage's view of the pipeline: its chunks, its p2p groups, its schedule runner.

    `chunks[c]` are the global layers of model chunk c (all pp x virtual chunks); this
    stage runs chunks stage, stage + pp, stage + 2 pp, ...
    """

    def __init__(
        self,
        grid: ProcessGrid,
        chunks: Sequence[range],
        activation_shape: tuple[int, ...],
        timers: Optional[StepTimers] = None,
        prefetch: bool = True,
    ) -> None:
        self.pp, self.stage = grid.size("pp"), grid.coords["pp"]
        self.virtual = len(chunks) // self.pp
        self.chunks, self.activation_shape, self.timers = list(chunks), activation_shape, timers
        self.prefetch = prefetch
        self.ranks = grid.ranks["pp"]
        # One group per message stream (see the module docstring); the wrap-around streams exist
        # only in the interleaved schedule. The grid owns them, so pipelines built on it share them.
        self.groups, self.tied_group = grid.pipeline_groups(wrap_around=self.virtual > 1)
        self._proofs: dict[int, dict[Message, tuple[Message, ...]]] = {}  # by micro-batch count

    @property
    def my_chunks(self) -> list[int]:
        return [v * self.pp + self.stage for v in range(self.virtual)]

    @property
    def layers(self) -> list[int]:
        """Global indices of the layers this stage holds."""
        return [i for c in self.my_chunks for i in self.chunks[c]]

    @property
    def first(self) -> bool:
        """Whether this stage runs the first chunk (embedding)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this stage runs the last chunk (head and loss)."""
        return self.stage == self.pp - 1

    def _group(self, kind: str, src_stage: int) -> Any:
        """The group carrying `kind` ('F' activations, 'B' gradients) sent by `src_stage`."""
        wrap = src_stage == (self.pp - 1 if kind == "F" else 0)
        return self.groups[(kind, wrap)]

    def _post_recv(self, kind: str, src_stage: int, micro: int, dtype: torch.dtype, device: torch.device) -> tuple:
        """Post the receive of micro-batch `micro`'s message. Watched: on NCCL the first p2p call
        between two ranks creates their communicator and blocks, and gloo fails here on a lost
        peer; the watchdog then names this receive and its micro-batch."""
        buffer = torch.empty(self.activation_shape, dtype=dtype, device=device)
        op = f"irecv from stage {src_stage}"
        if self.timers is not None:
            self.timers.watchdog.at(micro=micro)  # the caller names its own action's micro-batch again
        with comm_region(self.timers, "pp", op):
            work = dist.irecv(buffer, self.ranks[src_stage], group=self._group(kind, src_stage))
        return launch(self.timers, "pp", work, op), buffer

    def _send(self, message: Message, tensor: torch.Tensor, sends: Sends) -> None:
        payload = tensor.detach().contiguous()  # kept alive in `sends` until the send is known delivered
        dst_stage = message.route(self.pp)[1]
        with comm_region(self.timers, "pp", f"isend to stage {dst_stage}"):
            work = dist.isend(payload, self.ranks[dst_stage], group=self._group(message.kind, self.stage))
        sends.add(message, work, payload, dst_stage)

    def _proofs_for(self, n: int) -> dict[Message, tuple[Message, ...]]:
        """`schedule.send_proofs` of this stage for `n` micro-batches, computed once."""
        if n not in self._proofs:
            schedules = [build_schedule(self.pp, s, n, self.virtual) for s in range(self.pp)]
            self._proofs[n] = send_proofs(schedules, self.stage, self.pp, self.virtual)
        return self._proofs[n]

    def _chunk(self, action: Action) -> int:
        """The model chunk `action` runs on this stage."""
        return action.virtual * self.pp + self.stage

    def _messages(self, action: Action) -> tuple[Optional[Message], Optional[Message]]:
        """What `action` receives first and sends after (`schedule.messages`, the routes the
        simulator checks)."""
        return messages(action, self.stage, self.pp, self.virtual)

    def _recv_of(self, action: Action) -> Optional[tuple[str, int]]:
        """(kind, source stage) of the message `action` must receive, if any."""
        recv, _ = self._messages(action)
        return None if recv is None else (recv.kind, recv.route(self.pp)[0])

    def _send_group_of(self, action: Action) -> Any:
        """The group `action` sends its result on (None: it sends nothing)."""
        _, send = self._messages(action)
        return None if send is None else self._group(send.kind, self.stage)

    def run(
        self, model: GPT, micro_batches: Sequence[tuple[torch.Tensor, Targets]], loss_scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch through this stage's chunks.

        Gradients of (mean loss over the micro-batches) x `loss_scale` reach the parameters'
        gradient hooks. Returns the sum of the micro-batch losses / n on the last stage (the
        mean loss of this dp rank's share, unscaled), zero elsewhere.
        """
        n = len(micro_batches)
        last_chunk = self.pp * self.virtual - 1
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        loss_sum = torch.zeros((), device=device)
        # Mixture of experts: the routers' losses join each micro-batch's loss at its scale.
        model.router_stats.reset()
        model.router_stats.scale = loss_scale / n
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        sends = Sends(self.timers, self._proofs_for(n))
        actions = build_schedule(self.pp, self.stage, n, self.virtual)
        posted: dict[int, tuple] = {}  # action index -> (pending receive, buffer)

        def post(i: int) -> None:
            need = self._recv_of(actions[i]) if i < len(actions) and i not in posted else None
            if need is not None:
                posted[i] = self._post_recv(*need, actions[i].micro, dtype, device)

        def received(i: int) -> torch.Tensor:
            pending, buffer = posted.pop(i)
            wait(self.timers, pending)
            recv, _ = self._messages(actions[i])
            sends.received(recv)  # this message left its peer after some of our sends arrived there
            return buffer

        for i, action in enumerate(actions):
            sends.poll()
            post(i)
            # Prefetch: post the next action's receive before computing this one — unless it
            # would queue on the group this action sends on (on NCCL a group's operations run
            # in order, and a receive queued ahead of a send could wait on it in a cycle).
            if self.prefetch and i + 1 < len(actions):
                need = self._recv_of(actions[i + 1])
                if need is not None and self._group(*need) is not self._send_group_of(action):
                    post(i + 1)
            chunk = self._chunk(action)
            first, last = chunk == 0, chunk == last_chunk
            _, send = self._messages(action)  # None: the last chunk's forward, the first's backward
            tokens, targets = micro_batches[action.micro]
            if self.timers is not None:
                self.timers.watchdog.at(micro=action.micro)  # named if this rank hangs in this action
            if action.kind == "F":
                with self._phase("forward"):
                    x = tokens if first else received(i).requires_grad_()
                    out = model.forward_chunk(x, self.chunks[chunk], first, last, targets if last else None)
                if send is None:
                    out = out / n
                    loss_sum += out.detach()
                else:
                    self._send(send, out, sends)
                saved[(action.micro, chunk)] = (x, out)
            else:
                x, out = saved.pop((action.micro, chunk))
                with self._phase("backward"):
                    if last:
                        (out * loss_scale if loss_scale != 1.0 else out).backward()
                    else:
                        torch.autograd.backward(out, received(i))
                    model.finish_backward()  # 3D's reduce-scatters still in flight (ORS) land first
                if send is not None:
                    self._send(send, x.grad, sends)
        sends.wait_all()
        return loss_sum

    def evaluate(self, model: GPT, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward passes only, without autograd (evaluation): every micro-batch through this
        stage's chunks, micro-batch by micro-batch and each through the chunks in order, so that
        every pass waits only for an earlier one (no deadlock, no schedule needed). Returns the
        sum of the micro-batch mean losses / n on the last stage, zero elsewhere.

        No message comes back to prove a send delivered (one virtual stage), so a stage holding
        more than pp sends waits for its oldest: its receiver's pass comes earlier in the order
        every stage follows (micro-batch, then chunk) than anything this stage runs next, and
        needs only earlier passes, so the wait cannot close a cycle."""
        n = len(micro_batches)
        last_chunk = self.pp * self.virtual - 1
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        loss_sum = torch.zeros((), device=device)
        sends = Sends(self.timers, {})
        with torch.no_grad():
            for micro, (tokens, targets) in enumerate(micro_batches):
                if self.timers is not None:
                    self.timers.watchdog.at(micro=micro)  # named if this rank hangs in this micro-batch
                for virtual in range(self.virtual):
                    sends.poll()
                    action = Action("F", micro, virtual)
                    recv, send = self._messages(action)
                    chunk = self._chunk(action)
                    if recv is None:
                        x = tokens
                    else:
                        pending, x = self._post_recv(recv.kind, recv.route(self.pp)[0], micro, dtype, device)
                        wait(self.timers, pending)
                    last = chunk == last_chunk
                    out = model.forward_chunk(x, self.chunks[chunk], chunk == 0, last, targets if last else None)
                    if send is None:
                        loss_sum += out.float() / n
                    else:
                        self._send(send, out, sends)
                        if len(sends.held) > self.pp:
                            sends.drop([next(iter(sends.held))])
            sends.wait_all()
        return loss_sum

    def _phase(self, name: str) -> Any:
        return self.timers.phase(name) if self.timers is not None else nullcontext()
