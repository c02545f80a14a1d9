"""Helpers of scripts/h200_hicache_bench.sh (stdlib only).

  scrape URL OUT.json                 the server's /metrics (ketch_* samples) as {"name{labels}": value}
  row NAME BENCH.json BEFORE.json AFTER.json SUMMARY.json [--timed-out S] [--note TEXT]
                                      one configuration's row (client figures from `ketch bench serve
                                      --output-file`, server counters as after - before) into SUMMARY
  table SUMMARY.json [MORE.json ...]  the side-by-side table (several summaries: the split calls merged)
  l3cap DIR MAX_GB LOG                a bounded file store: every 2 s, while DIR holds more than MAX_GB,
                                      delete its oldest files (by mtime) down to 90 % of it (the file
                                      backend has no size limit; the device machine's disk is 64 GiB)
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

GB = 1e9


def scrape(url: str, out: str) -> None:
    vals: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError as e:
        text = ""
        vals["scrape_error"] = str(e)  # type: ignore[assignment]
    for line in text.splitlines():
        if line.startswith("ketch_"):
            name, _, value = line.rpartition(" ")
            try:
                vals[name] = float(value)
            except ValueError:
                pass
    with open(out, "w") as f:
        json.dump(vals, f, indent=1, sort_keys=True)


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def row(name: str, bench: str, before: str, after: str, summary: str, timed_out: float | None, note: str) -> None:
    b, m0, m1 = _load(bench), _load(before), _load(after)
    d = {k: v - m0.get(k, 0.0) for k, v in m1.items() if isinstance(v, float) and k.endswith(("_total", "}"))}
    d = {k: v for k, v in d.items() if "_created" not in k}

    def c(key: str) -> float:
        return d.get(key, 0.0)

    r: dict = {"config": name, "note": note}
    if timed_out is not None:
        r["timed_out_after_s"] = timed_out
    m = b.get("metrics")
    if m:
        mt = m.get("multiturn") or {}
        per = mt.get("per_round") or []
        r |= {"clients": mt.get("clients"), "rounds": mt.get("rounds"),
              "completed": m["completed"], "failed": m["failed"], "duration_s": round(m["duration_s"], 1),
              "mean_ttft_ms_rounds_2plus": mt.get("mean_ttft_ms_rounds_2plus"),
              "mean_ttft_ms_round_1": per[0]["mean_ttft_ms"] if per else None,
              "mean_ttft_ms_last_round": per[-1]["mean_ttft_ms"] if per else None,
              "hit_rate_rounds_2plus": mt.get("cache_hit_rate_rounds_2plus"),
              "output_tok_s": round(m["output_throughput"], 1), "total_tok_s": round(m["total_throughput"], 1),
              "per_round": [{k: x[k] for k in ("round", "completed", "failed", "mean_ttft_ms", "median_ttft_ms",
                                               "prompt_tokens", "cached_tokens", "cache_hit_rate")} for x in per]}
    hits = {t: c(f'ketch_cache_hit_tokens_total{{tier="{t}"}}') for t in ("device", "host", "storage")}
    steps = c("ketch_engine_steps_total")
    r |= {"hit_tokens": hits, "preemptions": c("ketch_preemptions_total"),
          "engine_mean_step_ms": round(1e3 * c("ketch_engine_step_seconds_total") / steps, 2) if steps else None}
    loaded, load_s = c("ketch_hicache_loaded_bytes_total"), c("ketch_hicache_load_seconds_total")
    copy_s = c("ketch_hicache_load_copy_seconds_total")  # the copies' own time (CUDA events on the copy stream)
    saved, save_s = c("ketch_hicache_saved_bytes_total"), c("ketch_hicache_save_seconds_total")
    if "ketch_hicache_save_copy_seconds_total" in m1:  # the copies' own time (CUDA: copy-stream events)
        save_s = c("ketch_hicache_save_copy_seconds_total")
    if "ketch_kv_host_pages_total" in m1:
        r |= {"host_pages": m1["ketch_kv_host_pages_total"],
              "h2d_loaded_gb": round(loaded / GB, 2), "h2d_load_seconds": round(load_s, 2),
              "h2d_gbs_load_clock": round(loaded / GB / load_s, 2) if load_s else None,
              "h2d_copy_seconds": round(copy_s, 3), "h2d_gbs": round(loaded / GB / copy_s, 2) if copy_s else None,
              "d2h_saved_gb": round(saved / GB, 2), "d2h_save_seconds": round(save_s, 2),
              "d2h_gbs_save_clock": round(saved / GB / save_s, 2) if save_s else None,
              "host_evicted_pages": c("ketch_hicache_host_evicted_pages_total"),
              "dropped_pages": c("ketch_hicache_dropped_pages_total")}
    if "ketch_hicache_storage_written_bytes_total" in m1:
        rd, rs = c("ketch_hicache_storage_read_bytes_total"), c("ketch_hicache_storage_read_seconds_total")
        wr, ws = c("ketch_hicache_storage_written_bytes_total"), c("ketch_hicache_storage_write_seconds_total")
        r |= {"l3_read_gb": round(rd / GB, 2), "l3_read_gbs": round(rd / GB / rs, 2) if rs else None,
              "l3_written_gb": round(wr / GB, 2), "l3_write_gbs": round(wr / GB / ws, 2) if ws else None,
              "l3_dropped_writes": c("ketch_hicache_storage_dropped_writes_total"),
              "l3_errors": c("ketch_hicache_storage_errors_total") + c("ketch_hicache_storage_read_errors_total"),
              "l3_prefetches": c("ketch_hicache_prefetches_total"),
              "l3_prefetch_timeouts": c("ketch_hicache_prefetch_timeouts_total"),
              "l3_prefetch_wait_s": round(c("ketch_hicache_prefetch_wait_seconds_total"), 2)}
    r["server_counters_delta"] = d
    s = _load(summary)
    s.setdefault("configs", {})[name] = r
    with open(summary, "w") as f:
        json.dump(s, f, indent=1)


def _fmt(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def table(paths: list[str]) -> None:
    configs: dict = {}
    peak = None
    for p in paths:
        s = _load(p)
        configs |= s.get("configs", {})
        peak = peak or (s.get("pcie") or {}).get("h2d_peak_gbs")
    order = [n for n in ("radix", "l2", "l3") if n in configs] + [n for n in configs if n not in ("radix", "l2", "l3")]
    base = (configs.get("radix") or {}).get("mean_ttft_ms_rounds_2plus")
    print(f"PCIe h2d peak (pinned, 1 GiB, CUDA events): {_fmt(peak, '.1f')} GB/s")
    cols = ("config", "cl x rd", "TTFT r>=2 ms", "vs radix", "TTFT r1 ms", "TTFT last ms", "hit r>=2",
            "hit tok dev/host/L3 (k)", "out tok/s", "tot tok/s", "dur s", "h2d GB", "h2d GB/s*", "% peak",
            "d2h GB/s*", "L3 rd/wr GB", "preempt")
    rows = []
    for n in order:
        r = configs[n]
        t2 = r.get("mean_ttft_ms_rounds_2plus")
        h = r.get("hit_tokens", {})
        gbs = r.get("h2d_gbs") or r.get("h2d_gbs_load_clock")
        rows.append((
            n + (" (TIMED OUT)" if "timed_out_after_s" in r else ""),
            f"{r.get('clients')}x{r.get('rounds')}",
            _fmt(t2), f"{base / t2:.2f}x" if base and t2 else "-",
            _fmt(r.get("mean_ttft_ms_round_1")), _fmt(r.get("mean_ttft_ms_last_round")),
            f"{100 * r['hit_rate_rounds_2plus']:.1f}%" if r.get("hit_rate_rounds_2plus") is not None else "-",
            "/".join(f"{h.get(t, 0) / 1e3:.1f}" for t in ("device", "host", "storage")),
            _fmt(r.get("output_tok_s"), ".1f"), _fmt(r.get("total_tok_s"), ".0f"), _fmt(r.get("duration_s"), ".0f"),
            _fmt(r.get("h2d_loaded_gb"), ".1f"), _fmt(gbs, ".2f"),
            f"{100 * gbs / peak:.0f}%" if gbs and peak else "-",
            _fmt(r.get("d2h_gbs_save_clock"), ".2f"),
            f"{r['l3_read_gb']:.1f}/{r['l3_written_gb']:.1f}" if "l3_read_gb" in r else "-",
            _fmt(r.get("preemptions")),
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    for line in (cols, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    print("* h2d GB/s: loaded bytes over ketch_hicache_load_copy_seconds (the copies' own time: CUDA events on the "
          "loader's copy stream; on the CPU the copies' wall time). d2h GB/s: saved bytes over "
          "ketch_hicache_save_copy_seconds (the same, for saves) where the server exports it.")
    for n in order:
        r = configs[n]
        if r.get("note"):
            print(f"note {n}: {r['note']}")
        extra = {k: r[k] for k in ("l3_dropped_writes", "l3_errors", "l3_prefetches", "l3_prefetch_timeouts",
                                   "l3_prefetch_wait_s", "l3_read_gbs", "l3_write_gbs", "host_evicted_pages",
                                   "dropped_pages", "engine_mean_step_ms", "failed") if k in r}
        if extra:
            print(f"{n}: " + ", ".join(f"{k}={v}" for k, v in extra.items()))


def l3cap(root: str, max_gb: float, log: str) -> None:
    cap, deleted, freed = max_gb * GB, 0, 0
    while True:
        files, total = [], 0
        for dirpath, _, names in os.walk(root):
            for nm in names:
                p = os.path.join(dirpath, nm)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                files.append((st.st_mtime, st.st_size, p))
                total += st.st_size
        if total > cap:
            files.sort()
            for _, size, p in files:
                if total <= 0.9 * cap:
                    break
                try:
                    os.unlink(p)
                except OSError:
                    continue
                total -= size
                deleted += 1
                freed += size
            with open(log, "w") as f:
                f.write(f"l3cap: {deleted} files / {freed / GB:.1f} GB deleted (oldest first) to keep {root} "
                        f"under {max_gb} GB\n")
        time.sleep(2)


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "scrape":
        scrape(*args)
    elif cmd == "row":
        timed_out = note = None
        if "--timed-out" in args:
            i = args.index("--timed-out")
            timed_out = float(args[i + 1])
            del args[i:i + 2]
        if "--note" in args:
            i = args.index("--note")
            note = args[i + 1]
            del args[i:i + 2]
        row(*args, timed_out=timed_out, note=note or "")
    elif cmd == "table":
        table(args)
    elif cmd == "l3cap":
        l3cap(args[0], float(args[1]), args[2])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
