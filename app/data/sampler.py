"""Which sample indices each data-parallel rank trains on, step by step.

Step s covers the contiguous global batch [consumed, consumed + global_batch). DP rank r
takes the r-th contiguous chunk of global_batch // dp_size indices, split into micro-batches
in order, so the union over ranks is the same global batch whatever dp_size is.
"""

from __future__ import annotations


class GlobalBatchSampler:
    """Yields this DP rank's micro-batch indices for each global batch; resumable."""

    def __init__(
        self,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
    ) -> None:
        if min(global_batch, micro_batch, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"bad sampler sizes: global_batch={global_batch}, "
                f"micro_batch={micro_batch}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if global_batch % (micro_batch * dp_size) != 0:
            raise ValueError(
                f"global_batch {global_batch} is not a multiple of micro_batch {micro_batch} x dp_size {dp_size}"
            )
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.num_micro_batches = global_batch // (micro_batch * dp_size)

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next global batch: num_micro_batches x micro_batch."""
        start = self.consumed_samples + self.dp_rank * (self.global_batch // self.dp_size)
        mb, n = self.micro_batch, self.num_micro_batches
        self.consumed_samples += self.global_batch
        return [list(range(start + m * mb, start + (m + 1) * mb)) for m in range(n)]

    def state_dict(self) -> dict:
        """The position in the sample stream, saved with the checkpoint."""
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
