"""Pipeline schedules as pure data: which (forward | backward, micro-batch, chunk) each stage runs.

The model is cut into `pp x virtual_stages` chunks of consecutive layers; chunk c runs on
stage c % pp as that stage's virtual chunk c // pp (Megatron's interleaved layout,
Narayanan et al., SC21). With one virtual stage this is plain 1F1B (PipeDream-Flush):
each stage runs a few warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards, so at most pp micro-batches are in flight.

`simulate` runs every stage's action list against each other without tensors (sends never
block, a receive waits for its send) and reports deadlocks, missing or repeated passes,
and message streams whose send and receive orders differ (p2p matching is FIFO per pair of
ranks and group, on NCCL as on Gloo).

`send_proofs` says, for each message a stage receives, which of its own earlier sends that
receipt proves delivered (the peer sent it only after receiving them), so that the executor
can free a send's buffer then instead of holding every message of the step to its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """One pass on one stage: kind 'F' or 'B', micro-batch index, virtual chunk index."""

    kind: str
    micro: int
    virtual: int


def one_f_one_b(pp: int, stage: int, micro_batches: int) -> list[Action]:
    """1F1B: warm-up forwards (pp - stage - 1), steady F/B pairs, cool-down backwards."""
    warmup = min(pp - stage - 1, micro_batches)
    actions = [Action("F", m, 0) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        actions += [Action("F", warmup + m, 0), Action("B", m, 0)]
    actions += [Action("B", m, 0) for m in range(micro_batches - warmup, micro_batches)]
    return actions


def interleaved_one_f_one_b(pp: int, stage: int, micro_batches: int, virtual: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): micro-batches go through the virtual chunks in
    groups of pp; needs micro_batches % pp == 0."""
    if micro_batches % pp:
        raise ValueError(f"interleaved schedule needs micro_batches ({micro_batches}) divisible by pp ({pp})")
    total = micro_batches * virtual

    def action(kind: str, k: int) -> Action:
        group, within = divmod(k, pp * virtual)
        chunk = within // pp
        return Action(kind, group * pp + within % pp, chunk if kind == "F" else virtual - 1 - chunk)

    # With micro_batches == pp there are too few micro-batches for a steady state: all forwards first.
    warmup = total if micro_batches == pp else min(total, (pp - stage - 1) * 2 + (virtual - 1) * pp)
    actions = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [action("F", warmup + k), action("B", k)]
    actions += [action("B", k) for k in range(total - warmup, total)]
    return actions


def build_schedule(pp: int, stage: int, micro_batches: int, virtual: int = 1) -> list[Action]:
    """The action list of `stage`: 1F1B, or interleaved 1F1B when virtual > 1."""
    if virtual == 1:
        return one_f_one_b(pp, stage, micro_batches)
    return interleaved_one_f_one_b(pp, stage, micro_batches, virtual)


@dataclass(frozen=True)
class Message:
    """A p2p transfer: activation ('F', to the next chunk) or gradient ('B', to the previous)."""

    kind: str
    micro: int
    chunk: int  # the global chunk that produced it

    def route(self, pp: int) -> tuple[int, int]:
        """(source stage, destination stage)."""
        src = self.chunk % pp
        return src, (src + 1) % pp if self.kind == "F" else (src - 1) % pp


def messages(action: Action, stage: int, pp: int, virtual: int) -> tuple[Message | None, Message | None]:
    """(the message `action` must receive first, the message it sends after), None if none."""
    chunk = action.virtual * pp + stage
    last = pp * virtual - 1
    if action.kind == "F":
        recv = Message("F", action.micro, chunk - 1) if chunk > 0 else None
        send = Message("F", action.micro, chunk) if chunk < last else None
    else:
        recv = Message("B", action.micro, chunk + 1) if chunk < last else None
        send = Message("B", action.micro, chunk) if chunk > 0 else None
    return recv, send


def simulate(pp: int, micro_batches: int, virtual: int = 1) -> dict[str, int]:
    """Run all stages' schedules together; raise RuntimeError on deadlock or a wrong schedule.

    Returns {'ticks': rounds of the simulation, 'max_in_flight': most forwards awaiting
    their backward on one stage}.
    """
    schedules = [build_schedule(pp, s, micro_batches, virtual) for s in range(pp)]
    for stage, actions in enumerate(schedules):
        for kind in "FB":
            done = sorted((a.micro, a.virtual) for a in actions if a.kind == kind)
            want = sorted((m, v) for m in range(micro_batches) for v in range(virtual))
            if done != want:
                raise RuntimeError(f"stage {stage}: {kind} passes {done} != one per (micro-batch, chunk)")
    sent: dict[tuple[str, int, int], list[Message]] = {}  # (kind, src, dst) -> FIFO of sent messages
    received: dict[tuple[str, int, int], int] = {}
    position, in_flight, max_in_flight, ticks = [0] * pp, [0] * pp, 0, 0
    finished: set[tuple[str, int, int]] = set()  # (kind, micro, global chunk) passes already run
    while any(position[s] < len(schedules[s]) for s in range(pp)):
        ticks += 1
        progressed = False
        for stage in range(pp):
            if position[stage] == len(schedules[stage]):
                continue
            action = schedules[stage][position[stage]]
            chunk = action.virtual * pp + stage
            recv, send = messages(action, stage, pp, virtual)
            if action.kind == "B" and ("F", action.micro, chunk) not in finished:
                raise RuntimeError(f"stage {stage}: backward of micro-batch {action.micro} before its forward")
            if recv is not None:
                key = (recv.kind, *recv.route(pp))
                queue, head = sent.get(key, []), received.get(key, 0)
                if head >= len(queue):
                    continue  # waits for the send
                if queue[head] != recv:  # FIFO matching would hand this receive another message
                    raise RuntimeError(f"stage {stage} expects {recv} but the next message on {key} is {queue[head]}")
                received[key] = head + 1
            if send is not None:
                sent.setdefault((send.kind, *send.route(pp)), []).append(send)
            finished.add((action.kind, action.micro, chunk))
            in_flight[stage] += 1 if action.kind == "F" else -1
            max_in_flight = max(max_in_flight, in_flight[stage])
            position[stage] += 1
            progressed = True
        if not progressed:
            stuck = {s: schedules[s][position[s]] for s in range(pp) if position[s] < len(schedules[s])}
            raise RuntimeError(f"deadlock: every unfinished stage waits for a message: {stuck}")
    return {"ticks": ticks, "max_in_flight": max_in_flight}


def send_proofs(
    schedules: Sequence[Sequence[Action]], stage: int, pp: int, virtual: int = 1
) -> dict[Message, tuple[Message, ...]]:
    """{message `stage` receives: its own sends that receiving it proves delivered}.

    `schedules[s]` is stage s's action list (`build_schedule`, or evaluation's forwards). A
    send S to stage d is received by one action of d; every message d sends from that action
    on leaves d after S arrived, and the first of them that goes back to `stage` proves S
    delivered once `stage` has received it: waiting on S's send then returns at once, and its
    buffer can go. A send that d answers with nothing later is in no tuple (waited at the end).
    """
    proofs: dict[Message, list[Message]] = {}
    for dst in sorted({send.route(pp)[1] for a in schedules[stage] if (send := messages(a, stage, pp, virtual)[1])}):
        # Walking d's list backwards: the next message back to `stage` from each action on.
        answer: Message | None = None
        for action in reversed(schedules[dst]):
            recv, send = messages(action, dst, pp, virtual)
            if send is not None and send.route(pp)[1] == stage:
                answer = send
            if recv is not None and recv.route(pp)[0] == stage and answer is not None:
                proofs.setdefault(answer, []).append(recv)
    return {message: tuple(sent) for message, sent in proofs.items()}


def held_sends(schedules: Sequence[Sequence[Action]], stage: int, pp: int, virtual: int = 1) -> int:
    """The most sends `stage` holds at once when each is released at the receipt `send_proofs`
    names (counted while an action computes: after its receive, before its send)."""
    proofs = send_proofs(schedules, stage, pp, virtual)
    held: set[Message] = set()
    most = 0
    for action in schedules[stage]:
        recv, send = messages(action, stage, pp, virtual)
        if recv is not None:
            held.difference_update(proofs.get(recv, ()))
        most = max(most, len(held))
        if send is not None:
            held.add(send)
    return most
