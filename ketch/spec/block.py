"""`block`: a draft head proposes a whole block of k tokens in one parallel pass from the target's
last hidden state (MTP / DSpark style), with a confidence per position; how many of them a step
verifies is chosen from those confidences and the measured cost of verify steps
(verify_schedule.py: "confidence-scheduled verify").

    the target's step ─▶ h: its final hidden state at the row that produced the sequence's last
                         token t (the engine keeps it per request: DraftInput.hidden)
    head:  z_i = norm(h + e(t) + p_i)           i = 1..k, all positions at once ([B, k, H])
           z_i = z_i + mlp(z_i)                 one SwiGLU block shared by the positions
           logits_i = lm_head(norm(z_i))        the target's own LM head (and embedding e)
           draft_i = argmax, confidence_i = its softmax probability
    verify_lengths(confidences, cost) ─▶ each sequence's draft cut to the positions that pay

The head's own weights (p, the MLP, two norms) are random, seeded, unless a safetensors file of
them is given (`--speculative-draft-model-path`): no trained head for the bundled model exists, so
tests judge it on losslessness and overhead, and benchmarks on acceptance with `oracle` (the
tokens of a recorded run, the head's confidences and cost): the machinery's upper bound.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

from ketch.layers.norm import RMSNorm
from ketch.spec.oracle import OracleProposer
from ketch.spec.proposer import DraftInput
from ketch.spec.verify_schedule import VerifyCost, verify_lengths

INIT_STD = 0.02  # of the head's random weights: a small update on h + e(t), as a fresh MTP head


class BlockDraftHead(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_positions: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.zeros(num_positions, hidden_size))
        self.in_norm = RMSNorm(hidden_size, eps)
        self.gate_up = nn.Parameter(torch.zeros(2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.zeros(hidden_size, intermediate_size))
        self.out_norm = RMSNorm(hidden_size, eps)

    def init_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in (self.positions, self.gate_up, self.down):
            p.data.copy_(torch.randn(p.shape, generator=g) * INIT_STD)

    def forward(self, hidden: torch.Tensor, last_embedding: torch.Tensor) -> torch.Tensor:
        """hidden, last_embedding: [B, H] -> the k positions' inputs to the LM head, [B * k, H]."""
        z = (hidden + last_embedding).unsqueeze(1) + self.positions.unsqueeze(0)  # [B, k, H]
        z = self.in_norm(z)
        gate, up = (z @ self.gate_up.t()).chunk(2, dim=-1)
        z = z + (nn.functional.silu(gate) * up) @ self.down.t()
        return self.out_norm(z).reshape(-1, z.shape[-1])


def block_head_for(model_config: Any, num_positions: int, weights_path: str | None, seed: int) -> BlockDraftHead:
    """The head over the target's hidden size (read here, not in the engine: the family's config
    is the model's business): random and seeded, or the safetensors file's weights."""
    hidden = model_config.hidden_size
    head = BlockDraftHead(hidden, hidden, num_positions, model_config.rms_norm_eps)
    if weights_path is None:
        head.init_random(seed)
        return head
    try:
        head.load_state_dict(safetensors.torch.load_file(weights_path), strict=True)
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:  # unreadable, or the wrong tensors
        raise ValueError(f"speculative_draft_model_path: {weights_path} is not a draft head for this model "
                         f"(hidden {hidden}, k {num_positions}): {e}") from None
    return head


class BlockProposer:
    name = "block"

    def __init__(self, head: BlockDraftHead, model: nn.Module, num_draft_tokens: int, cost: VerifyCost | None,
                 oracle: OracleProposer | None = None) -> None:
        """model: the target (its embed_tokens and compute_logits); cost: the engine's measured
        seconds per step by rows, None to verify every drafted position (--speculative-adaptive
        off: no choice depends on timing); oracle (benchmarks): its tokens instead of the head's."""
        self.head, self.model, self.k, self.cost, self.oracle = head, model, num_draft_tokens, cost, oracle

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftInput]) -> list[list[int]]:
        ready = [i for i, x in enumerate(batch) if x.hidden is not None and x.max_draft > 0]
        out: list[list[int]] = [[] for _ in batch]
        if not ready:
            return out
        hidden = torch.stack([batch[i].hidden for i in ready])
        last = torch.tensor([int(batch[i].token_ids[-1]) for i in ready], device=hidden.device)
        z = self.head(hidden, self.model.embed_tokens(last).to(hidden.dtype))
        probs = torch.softmax(self.model.compute_logits(z).float(), dim=-1)
        conf, ids = probs.max(dim=-1)
        conf = conf.view(len(ready), self.k).cpu().numpy()
        ids = ids.view(len(ready), self.k).tolist()
        room = [min(batch[i].max_draft, self.k) for i in ready]
        if self.oracle is not None:  # its tokens, sure of each (the head's pass still runs: its cost counts)
            guesses = self.oracle.propose([batch[i] for i in ready])
            ids = [d + [0] * (self.k - len(d)) for d in guesses]
            conf = np.array([[1.0] * len(d) + [0.0] * (self.k - len(d)) for d in guesses]).reshape(len(ready), self.k)
            room = [min(r, len(d)) for r, d in zip(room, guesses)]  # no more than it guessed
        lengths = room if self.cost is None else verify_lengths(conf, room, self.cost)
        for j, i in enumerate(ready):
            out[i] = ids[j][: lengths[j]]
        return out

    def check_invariants(self) -> None:
        pass
