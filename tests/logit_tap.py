"""Record the fp32 logits of every sampled row, per request, step by step (for parity tests that
compare logits, not only tokens). The runner sees only a ForwardBatch, so the tap learns the
step's requests where the engine launches it and pairs them with the runner's logits, which come
in the order of the chunks that sample."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ketch.engine.engine import Engine


class LogitTap:
    def __init__(self, engine: Engine, keep: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.clone) -> None:
        self.engine = engine
        self.keep = keep  # what to store of a row (a clone; or a host copy)
        self.rows: dict[str, list[torch.Tensor]] = {}
        self._chunks: list = []

    def __enter__(self) -> LogitTap:
        launch, forward = self.engine._launch, self.engine.runner.forward

        def tapped_launch(chunks):
            self._chunks = chunks
            return launch(chunks)

        def tapped_forward(batch):
            logits = forward(batch)
            sampling = [c for c in self._chunks if c.samples]
            assert len(sampling) == len(batch.sample_rows) == logits.shape[0], "the tap lost track of the step"
            for row, c in enumerate(sampling):
                self.rows.setdefault(c.req.rid, []).append(self.keep(logits[row]))
            return logits

        self.engine._launch = tapped_launch
        self.engine.runner.forward = tapped_forward
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine._launch  # the classes' methods again
        del self.engine.runner.forward
