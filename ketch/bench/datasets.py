"""Prompts for `ketch bench serve`: random token prompts (of lengths in a range, or a mix of fixed
lengths), ShareGPT conversations, groups of prompts sharing a generated system prompt, and the
random user turns of multi-turn conversations (bench/multiturn.py).

Each request carries its prompt text, the prompt's length in tokens by our tokenizer (the server's
own count, when it reports usage, replaces it later), the number of tokens to ask for and, in a
multi-turn conversation, the turns before it.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

# ShareGPT filters, as the usual serving benchmarks apply them: drop conversations too short to
# say anything about and ones that would not fit a small model's context.
MIN_SEQ_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


class TextTokenizer(Protocol):
    vocab_size: int
    all_special_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str  # the text, or in a conversation the new user turn
    prompt_len: int
    output_len: int
    # a conversation's earlier turns, user and assistant alternately (serve_client.py lays them out)
    history: tuple[str, ...] = ()
    group: int | None = None  # generated-shared-prefix: which system prompt the prompt starts with


def _count(tokenizer: TextTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _random_text(tokenizer: TextTokenizer, length: int, rng: random.Random, pool: list[int]) -> str:
    """Text of about `length` tokens from random token ids. Decoding then re-encoding can merge or
    split tokens, so trim or extend the ids until the text encodes back to the target length."""
    ids = [rng.choice(pool) for _ in range(length)]
    text = tokenizer.decode(ids)
    for _ in range(8):
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == length:
            break
        ids = got[:length] if len(got) > length else got + [rng.choice(pool) for _ in range(length - len(got))]
        text = tokenizer.decode(ids)
    return text


def _token_pool(tokenizer: TextTokenizer) -> list[int]:
    """The ids random text is drawn from: every id but the special ones."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def random_requests(tokenizer: TextTokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float, seed: int) -> list[SampleRequest]:
    """Lengths uniform in [max(1, int(len * range_ratio)), len] for input and output separately."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    if input_len < 1:
        raise ValueError(f"random_input_len: must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"random_output_len: must be >= 1, got {output_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"random_range_ratio: must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    out = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        text = _random_text(tokenizer, n_in, rng, pool)
        out.append(SampleRequest(text, _count(tokenizer, text), n_out))
    return out


def mixed_requests(tokenizer: TextTokenizer, num_prompts: int, input_lens: Sequence[int], weights: Sequence[float],
                   output_len: int, range_ratio: float, seed: int) -> list[SampleRequest]:
    """`--dataset-name mixed`: prompts of exactly one of `input_lens` tokens each, as many of each
    length as its share of `weights` says (largest remainder, so 2048,128 with weights 1,3 and 8
    prompts is exactly 2 long and 6 short), in an order shuffled by `seed`; output lengths as for
    random (uniform in [len * range_ratio, len])."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    if not input_lens or any(n < 1 for n in input_lens):
        raise ValueError(f"mixed_input_lens: one or more lengths >= 1, got {list(input_lens)}")
    if len(weights) != len(input_lens) or any(not w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"mixed_weights: one weight >= 0 per length of {list(input_lens)} (not all 0), "
                         f"got {list(weights)}")
    if output_len < 1:
        raise ValueError(f"random_output_len: must be >= 1, got {output_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"random_range_ratio: must be in [0, 1], got {range_ratio}")
    shares = [num_prompts * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])[:num_prompts - sum(counts)]:
        counts[i] += 1
    lens = [n for n, c in zip(input_lens, counts) for _ in range(c)]
    rng = random.Random(seed)
    rng.shuffle(lens)
    pool = _token_pool(tokenizer)
    out = []
    for n_in in lens:
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        text = _random_text(tokenizer, n_in, rng, pool)
        out.append(SampleRequest(text, _count(tokenizer, text), n_out))
    return out


def random_turns(tokenizer: TextTokenizer, num_clients: int, num_rounds: int, turn_len: int,
                 seed: int) -> list[list[str]]:
    """Each client's user turns, one per round: random text of `turn_len` tokens, reproducible by seed."""
    for name, value in (("multiturn_clients", num_clients), ("multiturn_rounds", num_rounds),
                        ("multiturn_turn_len", turn_len)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    return [[_random_text(tokenizer, turn_len, rng, pool) for _ in range(num_rounds)] for _ in range(num_clients)]


# Between a group's system prompt and a request's question (the layout of SGLang's bench_serving).
GSP_SEPARATOR = "\n\n"


def _shares_prefix(tokenizer: TextTokenizer, prefix_ids: list[int], text: str) -> bool:
    return tokenizer.encode(text, add_special_tokens=False)[:len(prefix_ids)] == prefix_ids


def shared_prefix_requests(tokenizer: TextTokenizer, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                           question_len: int, output_len: int, seed: int) -> list[SampleRequest]:
    """`--dataset-name generated-shared-prefix`: `num_groups` system prompts of `system_prompt_len`
    random tokens, each followed (after GSP_SEPARATOR) by `prompts_per_group` questions of
    `question_len` random tokens; every request asks for `output_len` tokens. Reproducible by seed.

    Each prompt's tokens start with exactly its group's system prompt and separator tokens (a
    question whose first characters would merge with the separator when tokenized is drawn again),
    so a prefix cache can serve that many tokens to every request of a group after its first. The
    requests are shuffled by seed, so a group's requests are spread over the run, between the
    other groups' ones (as SGLang shuffles them): which worker a request lands on decides whether
    its system prompt is already cached there."""
    for name, value in (("gsp_num_groups", num_groups), ("gsp_prompts_per_group", prompts_per_group),
                        ("gsp_system_prompt_len", system_prompt_len), ("gsp_question_len", question_len),
                        ("gsp_output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    out = []
    for g in range(num_groups):
        prefix = _random_text(tokenizer, system_prompt_len, rng, pool) + GSP_SEPARATOR
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
        for _ in range(prompts_per_group):
            for _ in range(16):
                text = prefix + _random_text(tokenizer, question_len, rng, pool)
                if _shares_prefix(tokenizer, prefix_ids, text):
                    break
            else:
                raise ValueError(f"gsp: no question kept group {g}'s system prompt tokens intact in 16 draws")
            out.append(SampleRequest(text, _count(tokenizer, text), output_len, group=g))
    rng.shuffle(out)
    return out


def _first_turns(conversation: list) -> tuple[str, str] | None:
    """The first human turn and the first model turn after it, or None if there is no such pair."""
    prompt = None
    for turn in conversation:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        role = turn.get("from")
        if prompt is None and role in ("human", "user"):
            prompt = turn["value"]
        elif prompt is not None and role in ("gpt", "assistant"):
            return prompt, turn["value"]
    return None


def sharegpt_requests(path: str, tokenizer: TextTokenizer, num_prompts: int, seed: int,
                      output_len: int | None = None) -> list[SampleRequest]:
    """Shuffled (by seed) conversations of a ShareGPT-format JSON file; the output length is the
    first model answer's token count unless `output_len` fixes it."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"dataset_path: cannot read ShareGPT JSON {path!r}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset_path: {path!r} must hold a JSON list of conversations")
    pairs = [p for entry in data if isinstance(entry, dict) and isinstance(entry.get("conversations"), list)
             and (p := _first_turns(entry["conversations"])) is not None]
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, answer in pairs:
        if len(out) == num_prompts:
            break
        n_in = _count(tokenizer, prompt)
        n_out = output_len if output_len is not None else _count(tokenizer, answer)
        if n_in < MIN_SEQ_LEN or n_out < MIN_SEQ_LEN:
            continue
        if n_in > MAX_PROMPT_LEN or n_in + n_out > MAX_TOTAL_LEN:
            continue
        out.append(SampleRequest(prompt, n_in, n_out))
    if not out:
        raise ValueError(f"dataset_path: no conversation in {path!r} passed the length filters")
    return out
