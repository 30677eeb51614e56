"""One evaluation's result (app/eval computes it; the run report logs it and summary.json holds
its record): the one eval record type, below both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the mean validation loss over `tokens` targets and its perplexity."""

    step: int
    loss: float
    perplexity: float
    samples: int
    tokens: int
    seconds: float
    source: str

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl / summary.json form."""
        return {
            "step": self.step,
            "loss": self.loss,
            "perplexity": self.perplexity,
            "samples": self.samples,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "source": self.source,
        }
