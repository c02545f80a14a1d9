"""Host <-> device copy bandwidth on CUDA: the ceiling the KV host tier (L2) is measured against.

Prints one JSON object. Rows (GB/s = 10^9 bytes/s; "gpu" = CUDA events around the queued copies,
"wall" = perf_counter from the first launch to a synchronize, Python launch overhead included):

  contiguous   one large copy (--contig-mib, default 1 GiB), --repeats times after a warmup:
               h2d / d2h from pinned memory (the PCIe peak the issue asks for) and from pageable
               memory (what a copy through an unpinned buffer gets).
  pages        copies shaped like the KV pool's pages: per layer and tensor ("k", "v") a page is
               page_size x kv_heads x head_dim x 2 B (Llama-3.1-8B, 16 tokens: 32 KiB per tensor,
               64 KiB per layer, 2 MiB over 32 layers), --pages pages at random ids:
    per_chunk        one copy per (layer, tensor, page) of 32 KiB, pinned -> device (a naive page loop);
                     --chunk-pages pages only (it is launch-bound: 64 copies per page)
    per_layer_run    one copy per (layer, tensor) of a contiguous run of pages on both sides (the best
                     the layer-first layout allows: host and device page ids both contiguous)
    pinned_gather    per (layer, tensor): host gather of the random pages into a pinned staging buffer,
                     one async copy, a device index_copy_ (a page-granular path that keeps DMA pinned)
    ketch_load       ketch's own HostPool.load (ketch/cache/host_pool.py) on a KVPool of this shape:
                     index_select on the pinned host pool (which makes an unpinned copy), .to(device),
                     index_copy_ -- what the L2 load path reaches as it stands
    ketch_save       HostPool.save, device -> host, likewise

  Without CUDA it prints {"cuda": false, "skipped": "no CUDA ..."} and exits 0. --dry-cpu runs every
  code path on CPU tensors at tiny sizes (a syntax and plumbing check; its numbers mean nothing).

  usage: python3 scripts/pcie_peak.py [--config configs/llama-3.1-8b] [--pages 1024] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "llama-3.1-8b"),
                   help="HF config.json or its directory: layers, kv heads, head dim")
    p.add_argument("--page-size", type=int, default=None, help="tokens per page (default: ketch's EngineConfig default)")
    p.add_argument("--contig-mib", type=int, default=1024, help="size of the contiguous copies")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each measurement (after one warmup)")
    p.add_argument("--pages", type=int, default=1024, help="pages moved by the page-shaped rows (1024 x 2 MiB = 2 GiB)")
    p.add_argument("--chunk-pages", type=int, default=128, help="pages moved by the per_chunk row (64 copies each)")
    p.add_argument("--device-pages", type=int, default=2048, help="device pool pages for the page rows (4 GiB at 8B)")
    p.add_argument("--dry-cpu", action="store_true", help="no CUDA: run every path on CPU tensors, tiny sizes")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def model_shape(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(cfg_path) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    return {"config": os.path.relpath(cfg_path, REPO) if cfg_path.startswith(REPO) else cfg_path,
            "layers": c["num_hidden_layers"], "kv_heads": c.get("num_key_value_heads", heads),
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads}


def default_page_size() -> tuple[int, str]:
    sys.path.insert(0, REPO)
    try:
        from ketch.config import EngineConfig
        return EngineConfig.__dataclass_fields__["page_size"].default, "ketch.config.EngineConfig"
    except Exception as e:  # noqa: BLE001 - report, do not fail: the copy rows need no ketch
        return 16, f"16 (ketch not importable: {type(e).__name__}: {e})"


class Clock:
    """GPU time from CUDA events (on the current stream) and wall time to a synchronize."""

    def __init__(self, torch, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda

    def time(self, fn) -> tuple[float, float]:
        t = self.torch
        if self.cuda:
            t.cuda.synchronize()
            a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            w0 = time.perf_counter()
            a.record()
            fn()
            b.record()
            t.cuda.synchronize()
            wall = time.perf_counter() - w0
            return a.elapsed_time(b) / 1e3, wall
        w0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - w0
        return wall, wall


def measure(clock: Clock, fn, nbytes: int, repeats: int, **extra) -> dict:
    fn()  # warmup (first-touch, allocator, lazy init)
    gpu, wall = [], []
    for _ in range(repeats):
        g, w = clock.time(fn)
        gpu.append(g)
        wall.append(w)
    return {"bytes": nbytes, "repeats": repeats, **extra,
            "gpu_gbs_best": round(nbytes / 1e9 / min(gpu), 2), "gpu_gbs_median": round(nbytes / 1e9 / statistics.median(gpu), 2),
            "wall_gbs_median": round(nbytes / 1e9 / statistics.median(wall), 2),
            "gpu_ms_median": round(1e3 * statistics.median(gpu), 3), "wall_ms_median": round(1e3 * statistics.median(wall), 3)}


def contiguous(torch, clock: Clock, dev, nbytes: int, repeats: int) -> dict:
    pin = dev.type == "cuda"
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = {}
    for kind, pinned in (("pinned", pin), ("pageable", False)):
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        h.fill_(1)
        d.fill_(2)
        out[f"h2d_{kind}"] = measure(clock, lambda: d.copy_(h, non_blocking=True), nbytes, repeats)
        out[f"d2h_{kind}"] = measure(clock, lambda: h.copy_(d, non_blocking=True), nbytes, repeats)
        del h
    del d
    return out


def page_rows(torch, clock: Clock, dev, shape: dict, page_size: int, a: argparse.Namespace) -> dict:
    pin = dev.type == "cuda"
    L, heads, hd = shape["layers"], shape["kv_heads"], shape["head_dim"]
    dtype = torch.bfloat16
    names = ("k", "v")
    row = (page_size, heads, hd)
    chunk_bytes = page_size * heads * hd * 2
    page_bytes = chunk_bytes * len(names) * L
    n, n_dev = a.pages, max(a.device_pages, a.pages)
    n_host = 2 * n
    g = torch.Generator().manual_seed(0)
    host_ids = torch.randperm(n_host, generator=g)[:n]
    dev_ids = torch.randperm(n_dev, generator=g)[:n]
    info = {"page_size": page_size, "chunk_bytes": chunk_bytes, "layer_page_bytes": chunk_bytes * len(names),
            "page_bytes": page_bytes, "pages": n}
    out: dict = {"shape": info}

    dev_layers = [{k: torch.zeros((n_dev, *row), dtype=dtype, device=dev) for k in names} for _ in range(L)]
    host_layers = [{k: torch.ones((n_host, *row), dtype=dtype, pin_memory=pin) for k in names} for _ in range(L)]

    # per_chunk: one 32 KiB copy per (layer, tensor, page)
    m = min(a.chunk_pages, n)
    hi, di = host_ids[:m].tolist(), dev_ids[:m].tolist()

    def per_chunk() -> None:
        for dl, hl in zip(dev_layers, host_layers):
            for k in names:
                dt, ht = dl[k], hl[k]
                for h_, d_ in zip(hi, di):
                    dt[d_].copy_(ht[h_], non_blocking=True)
    out["per_chunk"] = measure(clock, per_chunk, m * page_bytes, a.repeats, pages=m, copies=m * L * len(names))

    # per_layer_run: one copy per (layer, tensor) of n contiguous pages
    def per_layer_run() -> None:
        for dl, hl in zip(dev_layers, host_layers):
            for k in names:
                dl[k][:n].copy_(hl[k][:n], non_blocking=True)
    out["per_layer_run"] = measure(clock, per_layer_run, n * page_bytes, a.repeats, copies=L * len(names))

    # pinned_gather: host gather into a pinned staging buffer, one async copy, device scatter
    # (two staging buffers alternate so the gather of one tensor overlaps the copy of the last)
    stage = [torch.empty((n, *row), dtype=dtype, pin_memory=pin) for _ in range(2)]
    stage_dev = [torch.empty((n, *row), dtype=dtype, device=dev) for _ in range(2)]
    events = [None, None]
    d_idx = dev_ids.to(dev)

    def pinned_gather() -> None:
        i = 0
        for dl, hl in zip(dev_layers, host_layers):
            for k in names:
                s = i % 2
                if events[s] is not None:
                    events[s].synchronize()  # its last copy out of this staging buffer is done
                torch.index_select(hl[k], 0, host_ids, out=stage[s])
                stage_dev[s].copy_(stage[s], non_blocking=True)
                if pin:
                    events[s] = torch.cuda.Event()
                    events[s].record()
                dl[k].index_copy_(0, d_idx, stage_dev[s])
                i += 1
    out["pinned_gather"] = measure(clock, pinned_gather, n * page_bytes, a.repeats)
    del stage, stage_dev, dev_layers, host_layers

    # ketch's own host pool on a device pool of this shape
    try:
        sys.path.insert(0, REPO)
        from ketch.cache.host_pool import HostPool
        from ketch.cache.kv_pool import KVPool
        from ketch.config import KVSpec
    except Exception as e:  # noqa: BLE001
        out["ketch_load"] = out["ketch_save"] = {"skipped": f"ketch not importable: {type(e).__name__}: {e}"}
        return out
    pool = KVPool(KVSpec.mha(L, heads, hd), n_dev, page_size, dtype, dev)
    host = HostPool(pool, n_host)
    assert host.bytes_per_page == page_bytes, (host.bytes_per_page, page_bytes)
    hl, dl = host_ids.tolist(), dev_ids.tolist()
    out["ketch_load"] = measure(clock, lambda: host.load(hl, dl), n * page_bytes, a.repeats,
                                host_pinned=bool(pin and host.layers[0]["k"].is_pinned()))
    out["ketch_save"] = measure(clock, lambda: host.save(dl, hl), n * page_bytes, a.repeats)
    out["ketch_stats"] = {"loaded_bytes": host.stats.loaded_bytes, "loaded_seconds": round(host.stats.loaded_seconds, 4),
                          "loaded_gbs_by_its_own_clock": round(host.stats.loaded_bytes / 1e9 / host.stats.loaded_seconds, 2)
                          if host.stats.loaded_seconds else None,
                          "note": "HostPool's own clock (perf_counter around load(), what /metrics exports as "
                                  "ketch_hicache_load_seconds) vs the rows above"}
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"cuda": False, "skipped": f"no torch: {e}"}))
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not a.dry_cpu:
        text = json.dumps({"cuda": False, "skipped": "no CUDA: nothing measured (--dry-cpu exercises the code on CPU tensors)"})
        print(text)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text + "\n")
        return 0
    if not cuda:  # dry run: tiny sizes, every path
        a.contig_mib, a.pages, a.chunk_pages, a.device_pages, a.repeats = 4, 8, 2, 16, 2
    shape = model_shape(a.config)
    page_size, page_src = (a.page_size, "--page-size") if a.page_size else default_page_size()
    dev = torch.device("cuda" if cuda else "cpu")
    clock = Clock(torch, cuda)
    res: dict = {"cuda": cuda, "dry_cpu": not cuda, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "model": shape,
                 "page_size_from": page_src}
    t0 = time.perf_counter()
    nbytes = a.contig_mib << 20
    res["contiguous"] = contiguous(torch, clock, dev, nbytes, a.repeats)
    res["pages"] = page_rows(torch, clock, dev, shape, page_size, a)
    peak = res["contiguous"]["h2d_pinned"]["gpu_gbs_best"]
    res["h2d_peak_gbs"] = peak
    res["d2h_peak_gbs"] = res["contiguous"]["d2h_pinned"]["gpu_gbs_best"]
    res["pages_h2d_pct_of_peak"] = {k: round(100 * v["gpu_gbs_median"] / peak, 1)
                                    for k, v in res["pages"].items() if isinstance(v, dict) and "gpu_gbs_median" in v
                                    and k != "ketch_save"}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
