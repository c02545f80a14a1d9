"""EngineConfig's checks of its feature groups: sizes and the device, the hierarchical cache, expert
parallelism (and DP attention, EPLB), PD disaggregation and speculative decoding. A leaf below ketch/config.py
(which calls them from `EngineConfig.__post_init__`): it imports nothing of ketch."""
from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any

HICACHE_WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_back")  # SGLang's names
HICACHE_IO_BACKENDS: tuple[str, ...] = ("direct", "kernel")  # SGLang's --hicache-io-backend names
HICACHE_STORAGE_BACKENDS: tuple[str, ...] = ("file", "redis", "mooncake")  # L3 (ketch/cache/storage/)
DISAGGREGATION_MODES: tuple[str, ...] = ("null", "prefill", "decode")  # null: colocated (SGLang's name)
# hosts that bind every interface (a bracketed IPv6 one too): a socket there clashes with any host's
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
# the URL scheme each backend takes, and the form its error message shows
_STORAGE_URL_FORMS: dict[str, tuple[str, str]] = {"file": ("file:///", "file:///absolute/dir"),
                                                  "redis": ("redis://", "redis://host:port[/db]"),
                                                  "mooncake": ("mooncake://", "mooncake://master-host:port[?...]")}
SPECULATIVE_ALGORITHMS: tuple[str, ...] = ("ngram", "draft", "block")  # SGLang's --speculative-algorithm, lower case
# `block`'s head computes all k positions' logits for every request each step, B x k x vocab floats
# whatever the room left (k 50,000: 10 GB for one request of SmolLM2, the engine killed). Far past
# any useful block: the 7th drafted token survives < 10 % of the time (PRIOR_ART.md).
MAX_BLOCK_DRAFT_TOKENS = 64


def check_sizes(c: Any) -> None:
    """The counts are ints >= 1 (not floats that would be truncated, nor bools; max_model_len 0
    was once the model's default, silently), kv_cache_memory a finite number of bytes > 0."""
    required = ("page_size", "max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_bs")
    optional = ("max_model_len", "chunked_prefill_size", "num_threads")  # None: the default
    for name in required + optional:
        value = getattr(c, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    kv = c.kv_cache_memory
    if kv is not None and not (isinstance(kv, numbers.Real) and not isinstance(kv, bool) and math.isfinite(kv)
                               and kv > 0):
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {kv!r}")


def check_kernels(name: str, value: str, device: str) -> None:
    """attention_backend / layer_kernels: one of the names, and Triton only where it can run. On a
    CPU (no interpreter) Triton finds no driver only when a kernel launches, i.e. at the first
    request, which then kills the engine."""
    allowed = ("auto", "torch", "triton") + (("native",) if name == "layer_kernels" else ())
    if value not in allowed:
        raise ValueError(f"{name} must be {'|'.join(allowed)}, got {value!r}")
    # kernels/_common.interpreting()'s test, read here: importing it would load triton with the config
    if value == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and device_type(device) != "cuda":
        raise ValueError(f"{name}: 'triton' needs a CUDA device (or TRITON_INTERPRET=1), got {device_type(device)!r}")


_DEVICE_NAME = re.compile(r"(cpu|cuda)(:[0-9]+)?")


def check_device(device: Any) -> None:
    """auto | cpu | cuda[:N] (whether CUDA is there is the engine build's check: a config may be
    made and checked on a machine without it). Read without torch: `ketch serve` checks its config
    before it launches the engine process, and torch's import (~1.5 s) would hold that launch back."""
    if device != "auto" and not (isinstance(device, str) and _DEVICE_NAME.fullmatch(device)):
        raise ValueError(f"device must be auto|cpu|cuda[:N], got {device!r}")


def device_type(device: str) -> str:
    """"cpu" or "cuda" for a checked device name; "auto" asks torch whether CUDA is there."""
    if device != "auto":
        return device.split(":")[0]
    import torch  # only "auto" needs it (see check_device)

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_expert_parallel(c: Any) -> None:
    """ep_size is 1 or tensor_parallel_size (the EP ranks are the TP ranks, SGLang's
    ep_size == tp_size); redundant experts, EPLB and DP attention need EP."""
    for name, least in (("ep_size", 1), ("ep_num_redundant_experts", 0), ("eplb_rebalance_num_iterations", 1)):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if c.ep_size not in (1, c.tensor_parallel_size):
        raise ValueError(f"ep_size: {c.ep_size} must be 1 or tensor_parallel_size ({c.tensor_parallel_size}): "
                         f"experts are split over the tensor-parallel ranks")
    for name in ("ep_num_redundant_experts", "enable_eplb"):
        if getattr(c, name) and c.ep_size == 1:
            n = c.tensor_parallel_size  # EP splits the experts over the tensor-parallel ranks: 2 at least
            add = f"--ep-size {n}" if n > 1 else "--tp 2 --ep-size 2"
            raise ValueError(f"{name} (--{name.replace('_', '-')}) needs expert parallelism: add {add}")
    if c.enable_dp_attention and c.ep_size == 1:
        raise ValueError(f"enable_dp_attention: needs expert parallelism over the ranks: add --tp N --ep-size N "
                         f"(N >= 2; got tensor_parallel_size {c.tensor_parallel_size}, ep_size 1)")
    if c.enable_dp_attention and c.cpu_compile:
        raise ValueError("cpu_compile: not with enable_dp_attention (the MoE layers' collectives run inside the "
                         "forward; compiled decode graphs are not built for them)")


def check_disaggregation(c: Any, modes: tuple[str, ...]) -> None:
    if c.disaggregation_mode not in modes:
        raise ValueError(f"disaggregation_mode must be {'|'.join(modes)}, got {c.disaggregation_mode!r}")
    if c.disaggregation_transfer_backend not in ("fake", "tcp", "nixl", "mooncake"):
        raise ValueError(f"disaggregation_transfer_backend must be fake|tcp|nixl|mooncake, got {c.disaggregation_transfer_backend!r}")
    if not isinstance(c.disaggregation_bootstrap_port, int) or not 0 <= c.disaggregation_bootstrap_port <= 65535:
        raise ValueError(f"disaggregation_bootstrap_port must be an int in [0, 65535], got {c.disaggregation_bootstrap_port!r}")
    if not 0 < c.disaggregation_timeout < float("inf"):
        raise ValueError(f"disaggregation_timeout must be a number of seconds > 0, got {c.disaggregation_timeout!r}")
    if c.disaggregation_mode != "null" and c.tensor_parallel_size > 1:
        raise ValueError("disaggregation_mode: not supported with tensor_parallel_size > 1 yet")
    # a PD flag that the mode does not use is a mistake that showed only later, as 400s once a PD
    # gateway sent bootstrap fields (as check_hicache's rule: a tier's setting without the tier)
    defaults = {f: type(c).__dataclass_fields__[f].default for f in _PD_FLAGS}
    unused = [f for f in _PD_FLAGS if getattr(c, f) != defaults[f]]
    if c.disaggregation_mode == "null" and unused:
        raise ValueError(f"{unused[0]} (--{unused[0].replace('_', '-')}) needs PD disaggregation: add "
                         f"--disaggregation-mode prefill|decode")
    on_decode = [f for f in unused if "bootstrap" in f]
    if c.disaggregation_mode == "decode" and on_decode:
        raise ValueError(f"{on_decode[0]} (--{on_decode[0].replace('_', '-')}): a decode server has no bootstrap "
                         f"socket; each request names its prefill server's (the gateway's --prefill URL PORT)")


_PD_FLAGS = ("disaggregation_transfer_backend", "disaggregation_bootstrap_host", "disaggregation_bootstrap_port",
             "disaggregation_timeout")


def check_hicache(c: Any) -> None:
    """The hierarchical-cache fields; a size, ratio or policy without the switch is a mistake."""
    for name in ("enable_prefix_cache", "enable_hierarchical_cache"):  # "false" is truthy: a tier on silently
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(c, name)!r}")
    for name in ("hicache_ratio", "hicache_size"):  # a str (a JSON config's "2") raised a bare TypeError
        value = getattr(c, name)
        if not (isinstance(value, numbers.Real) and not isinstance(value, bool)) and (value, name) != (None, "hicache_size"):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if c.hicache_write_policy not in HICACHE_WRITE_POLICIES:
        raise ValueError(f"hicache_write_policy must be {'|'.join(HICACHE_WRITE_POLICIES)}, got {c.hicache_write_policy!r}")
    if c.hicache_io_backend not in HICACHE_IO_BACKENDS:
        raise ValueError(f"hicache_io_backend must be {'|'.join(HICACHE_IO_BACKENDS)}, got {c.hicache_io_backend!r}")
    if not 1.0 < c.hicache_ratio < math.inf:
        raise ValueError(f"hicache_ratio must be > 1 and finite (the host pool holds what the device evicts), "
                         f"got {c.hicache_ratio}")
    if c.hicache_size is not None and not 0 < c.hicache_size < math.inf:
        raise ValueError(f"hicache_size must be > 0 GB and finite, got {c.hicache_size}")
    if not c.hicache_prefetch_timeout >= 0:
        raise ValueError(f"hicache_prefetch_timeout must be >= 0 seconds, got {c.hicache_prefetch_timeout}")
    if not isinstance(c.hicache_storage_write_queue, int) or c.hicache_storage_write_queue < 1:
        raise ValueError(f"hicache_storage_write_queue must be an int >= 1 (pages), got {c.hicache_storage_write_queue!r}")
    _check_hicache_storage(c)
    if c.hicache_storage_backend is None:
        for name, default in (("hicache_prefetch_timeout", 1.0), ("hicache_storage_write_queue", 1024)):
            if getattr(c, name) != default:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) needs an L3 tier: add --hicache-storage-backend")
    if not c.enable_hierarchical_cache:
        for name, default in (("hicache_size", None), ("hicache_ratio", 2.0), ("hicache_write_policy", "write_through"),
                              ("hicache_io_backend", "kernel"), ("hicache_storage_backend", None),
                              ("hicache_storage_url", None)):
            if getattr(c, name) != default:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) needs the hierarchical cache: "
                                 f"add --enable-hierarchical-cache (enable_hierarchical_cache=True)")
        return
    if not c.enable_prefix_cache:
        raise ValueError("enable_hierarchical_cache: needs the prefix cache (drop --disable-prefix-cache)")
    if c.tensor_parallel_size > 1:
        raise ValueError("enable_hierarchical_cache: not supported with tensor_parallel_size > 1 yet")


def _check_hicache_storage(c: Any) -> None:
    """The L3 fields' own values (the switch is checked with the other hicache fields). The URL's
    full form is the backend's to check (ketch/cache/storage/); here only what the flags can say."""
    backend, url = c.hicache_storage_backend, c.hicache_storage_url
    if backend is not None and backend not in HICACHE_STORAGE_BACKENDS:
        raise ValueError(f"hicache_storage_backend must be {'|'.join(HICACHE_STORAGE_BACKENDS)}, got {backend!r}")
    if url is not None and backend is None:
        guess = next((b for b, (prefix, _) in _STORAGE_URL_FORMS.items() if url.startswith(prefix)), "file")
        raise ValueError(f"hicache_storage_url needs a backend: add --hicache-storage-backend {guess}")
    if url is not None and backend is not None:
        prefix, form = _STORAGE_URL_FORMS[backend]
        if not url.startswith(prefix):
            raise ValueError(f"hicache_storage_url: the {backend} backend takes {form}, got {url!r}")


def check_speculative(c: Any) -> None:
    """The speculative fields; a knob without --speculative-algorithm is a mistake, as is a draft
    model for an algorithm that has none."""
    algo = c.speculative_algorithm
    if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be {'|'.join(SPECULATIVE_ALGORITHMS)}, got {algo!r}")
    k, lo, hi = c.speculative_num_draft_tokens, c.speculative_ngram_min_match_window_size, \
        c.speculative_ngram_max_match_window_size
    for name, value in (("speculative_num_draft_tokens", k), ("speculative_ngram_min_match_window_size", lo),
                        ("speculative_ngram_max_match_window_size", hi)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if hi < lo:
        raise ValueError(f"speculative_ngram_max_match_window_size ({hi}) must be >= the min ({lo})")
    if not isinstance(c.speculative_adaptive, bool):  # "off" (the CLI's word) is truthy: the cost model stayed on
        raise ValueError(f"speculative_adaptive must be a bool (--speculative-adaptive on|off), "
                         f"got {c.speculative_adaptive!r}")
    if algo is None:
        for name, default in (("speculative_num_draft_tokens", 4), ("speculative_draft_model_path", None),
                              ("speculative_ngram_min_match_window_size", 1),
                              ("speculative_ngram_max_match_window_size", 12), ("speculative_adaptive", True)):
            if getattr(c, name) != default:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) needs speculation: add "
                                 f"--speculative-algorithm ngram|draft|block")
        return
    if algo == "draft" and not c.speculative_draft_model_path:
        raise ValueError("speculative_algorithm 'draft': add --speculative-draft-model-path (a smaller model "
                         "with the same tokenizer)")
    if algo == "ngram" and c.speculative_draft_model_path is not None:
        raise ValueError("speculative_draft_model_path: 'ngram' uses no model (it names the draft model for "
                         "'draft', the draft head's safetensors for 'block')")
    if algo == "block" and k > MAX_BLOCK_DRAFT_TOKENS:
        raise ValueError(f"speculative_num_draft_tokens: 'block' proposes all k positions each step; at most "
                         f"{MAX_BLOCK_DRAFT_TOKENS}, got {k}")
    if algo == "block" and c.speculative_draft_model_path and not c.speculative_draft_model_path.endswith(".safetensors"):
        raise ValueError("speculative_draft_model_path: for 'block' it is the draft head's weights, a .safetensors "
                         f"file, got {c.speculative_draft_model_path!r}")
    if c.tensor_parallel_size > 1:
        raise ValueError("speculative_algorithm: not supported with tensor_parallel_size > 1 yet")
    if c.disaggregation_mode == "prefill":
        raise ValueError("speculative_algorithm: a prefill server makes one token per request; speculate on the "
                         "decode server")
