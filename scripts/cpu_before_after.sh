#!/usr/bin/env bash
# ketch serve at its CPU defaults, two commits on one machine, in one interleaved session.
#
#   scripts/cpu_before_after.sh BEFORE_COMMIT AFTER_COMMIT [LOG]
#
# Each commit runs from its own detached worktree (WT_BEFORE, WT_AFTER; made here if missing and
# removed at the end only if made here) with the shared venv's python and PYTHONPATH=<worktree>.
# One client for both: the AFTER tree's `ketch bench serve` (random 256 in / 128 out, ignore_eos,
# --seed 0), N = 6 / 16 / 64 prompts at C = 1 / 8 / 32. One server at a time, started fresh for
# each run, GET /health == 200 before the client starts. Order: for each C, before, after, after,
# before (ABBA); PASSES such passes over all C.
#
# Load: before each run the machine must be quiet (a 10-s /proc/stat sample at most QUIET_MAX %
# busy; polled every 30 s, logged every QUIET_WAIT_S; the slot keeps its place in the order and
# waits; the session ends early after MAX_WAIT_TOTAL_S of waiting in all). During each run: uptime, and the CPU-seconds the machine
# spent minus those of this server's session, this client and this driver ("others"), as a share
# of the machine (2 vCPUs x the client's wall time).
#
# Set-aside rule (fixed before any result is read): a run is set aside when others used more than
# OTHERS_MAX % of the machine during its client window, a request failed, or the client exited
# non-zero. A run whose others' share so far passes ABORT_OTHERS % after ABORT_AFTER_S s is stopped
# there and set aside too (it would end far above OTHERS_MAX: no need to finish it). If a side has
# fewer than MIN_KEPT kept runs at some C after the passes, one more ABBA at that C is run at the
# end (up to MAKEUP_ROUNDS times). Medians per side and C are over the kept runs.
#
# Then the greedy identity check: a fresh BEFORE and a fresh AFTER server each get the same 14
# streaming requests at temperature 0 (6 /v1/completions, 6 /v1/chat/completions, max_tokens 48,
# and 2 more with stop=["."]); the joined streamed text, finish_reason and usage must be identical.
#
# env: REPO (the repository holding this script), PY ($REPO/.venv/bin/python), WORK (/tmp/cpu_ba),
#      WT_BEFORE (/tmp/wt-before), WT_AFTER (/tmp/wt-after), PORT (38011), PASSES (2),
#      CONCURRENCIES ("1 8 32"), OTHERS_MAX (15), QUIET_MAX (15), QUIET_WAIT_S (600), IDENTITY (1),
#      MIN_KEPT (3), MAKEUP_ROUNDS (2), ABORT_OTHERS (30), ABORT_AFTER_S (20), MAX_WAIT_TOTAL_S (14400)
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 BEFORE_COMMIT AFTER_COMMIT [LOG]" >&2
    exit 2
fi
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PY:-$REPO/.venv/bin/python}
WORK=${WORK:-/tmp/cpu_ba}
WT_BEFORE=${WT_BEFORE:-/tmp/wt-before}
WT_AFTER=${WT_AFTER:-/tmp/wt-after}
BEFORE=$(git -C "$REPO" rev-parse "$1^{commit}")
AFTER=$(git -C "$REPO" rev-parse "$2^{commit}")
LOG=${3:-$WORK/cpu-before-after.txt}
export REPO PY WORK WT_BEFORE WT_AFTER BEFORE AFTER LOG
export PORT=${PORT:-38011} PASSES=${PASSES:-2} CONCURRENCIES=${CONCURRENCIES:-"1 8 32"}
export OTHERS_MAX=${OTHERS_MAX:-15} QUIET_MAX=${QUIET_MAX:-15} QUIET_WAIT_S=${QUIET_WAIT_S:-600}
export IDENTITY=${IDENTITY:-1} MIN_KEPT=${MIN_KEPT:-3} MAKEUP_ROUNDS=${MAKEUP_ROUNDS:-2}
export ABORT_OTHERS=${ABORT_OTHERS:-30} ABORT_AFTER_S=${ABORT_AFTER_S:-20} MAX_WAIT_TOTAL_S=${MAX_WAIT_TOTAL_S:-14400}
mkdir -p "$WORK"
export PIDFILE=$WORK/servers.pgid
: > "$PIDFILE"

MADE=()
DRIVER=
cleanup() {
    # the driver first (on SIGTERM it stops its server and writes the log), then every server this
    # script started, each the leader of its own session/process group: end each group by its id
    # (its engine process is in it), then the worktrees made here
    if [ -n "$DRIVER" ] && kill -0 "$DRIVER" 2>/dev/null; then
        kill -TERM "$DRIVER" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$DRIVER" 2>/dev/null || break; sleep 1; done
        kill -KILL "$DRIVER" 2>/dev/null || true
    fi
    while read -r pgid; do
        [ -n "$pgid" ] && kill -0 -- "-$pgid" 2>/dev/null && kill -KILL -- "-$pgid" 2>/dev/null || true
    done < "$PIDFILE"
    for wt in "${MADE[@]}"; do
        git -C "$REPO" worktree remove --force "$wt" || true
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for pair in "$WT_BEFORE:$BEFORE" "$WT_AFTER:$AFTER"; do
    wt=${pair%%:*}
    commit=${pair#*:}
    if [ ! -d "$wt" ]; then
        git -C "$REPO" worktree add --detach "$wt" "$commit"
        MADE+=("$wt")
    fi
    have=$(git -C "$wt" rev-parse HEAD)
    if [ "$have" != "$commit" ]; then
        echo "$wt is at $have, not $commit" >&2
        exit 1
    fi
done

cat > "$WORK/driver.py" <<'PYEOF'
import json, os, signal, statistics, subprocess, sys, threading, time, urllib.error, urllib.request

E = os.environ
PY, WORK, LOG, PIDFILE = E["PY"], E["WORK"], E["LOG"], E["PIDFILE"]
WT = {"before": E["WT_BEFORE"], "after": E["WT_AFTER"]}
COMMIT = {"before": E["BEFORE"], "after": E["AFTER"]}
PORT = int(E["PORT"])
PASSES = int(E["PASSES"])
CONC = [int(c) for c in E["CONCURRENCIES"].split()]
N_PROMPTS = {1: 6, 8: 16, 32: 64}
MIN_KEPT, MAKEUP_ROUNDS = int(E["MIN_KEPT"]), int(E["MAKEUP_ROUNDS"])
ABORT_OTHERS, ABORT_AFTER_S = float(E["ABORT_OTHERS"]), float(E["ABORT_AFTER_S"])
MAX_WAIT_TOTAL_S = float(E["MAX_WAIT_TOTAL_S"])
OTHERS_MAX, QUIET_MAX, QUIET_WAIT_S = float(E["OTHERS_MAX"]), float(E["QUIET_MAX"]), float(E["QUIET_WAIT_S"])
HZ = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count()
URL = f"http://127.0.0.1:{PORT}"

waited_total = 0.0


class SessionOver(Exception):
    pass


header: list[str] = []
body: list[str] = []
runs: list[dict] = []
identity_lines: list[str] = []


def out(line: str = "", to: list | None = None) -> None:
    print(line, flush=True)
    (body if to is None else to).append(line)
    with open(os.path.join(WORK, "log.partial"), "a") as f:
        f.write(line + "\n")


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def machine_busy() -> float:
    """CPU-seconds the whole machine spent busy so far (user+nice+system+irq+softirq; steal and
    iowait are not this guest's work)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = f
    return (user + nice + system + irq + softirq) / HZ


def steal() -> float:
    """CPU-seconds the hypervisor gave to others while this guest wanted to run (host noise)."""
    return int(open("/proc/stat").readline().split()[8]) / HZ


def session_cpu(sid: int) -> float:
    """CPU-seconds of every live process in session `sid` (the server and its engine), with the
    children they reaped."""
    total = 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            s = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        rest = s[s.rfind(")") + 2:].split()
        if int(rest[3]) == sid:
            total += sum(int(x) for x in rest[11:15])
    return total / HZ


def session_pids(sid: int) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                s = open(f"/proc/{p}/stat").read()
            except OSError:
                continue
            if int(s[s.rfind(")") + 2:].split()[3]) == sid:
                pids.append(int(p))
    return pids


def wait_quiet() -> tuple[str, bool]:
    """Wait for a quiet machine: a 10-s sample under QUIET_MAX % busy (nothing of ours runs then)."""
    waited = 0.0
    while True:
        b0, t0 = machine_busy(), time.monotonic()
        time.sleep(10)
        busy = 100 * (machine_busy() - b0) / ((time.monotonic() - t0) * NCPU)
        waited += 10
        if busy <= QUIET_MAX:
            return f"waited {waited:.0f} s for a quiet machine (last 10-s sample {busy:.0f} % busy; quiet=yes)", True
        if waited >= QUIET_WAIT_S:
            return f"waited {waited:.0f} s; machine still {busy:.0f} % busy; quiet=NO", False
        print(f"  machine {busy:.0f} % busy ({sh('uptime')}); polling again in 30 s", flush=True)
        time.sleep(20)
        waited += 20


def http_get(path: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(URL + path, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def start_server(side: str, label: str) -> subprocess.Popen:
    cmd = [PY, "-m", "ketch.cli", "serve", "--host", "127.0.0.1", "--port", str(PORT)]
    out(f"server command: cd {WT[side]} && PYTHONPATH={WT[side]} {' '.join(cmd)}")
    if http_get("/health")[0]:
        raise RuntimeError(f"port {PORT} already answers: not ours")
    logf = open(os.path.join(WORK, f"server-{label}.log"), "w")
    p = subprocess.Popen(cmd, cwd=WT[side], env=E | {"PYTHONPATH": WT[side]}, stdout=logf,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    with open(PIDFILE, "a") as f:
        f.write(f"{p.pid}\n")
    t0 = time.monotonic()
    while http_get("/health")[0] != 200:
        if p.poll() is not None:
            raise RuntimeError(f"server exited {p.returncode} before /health; see {logf.name}")
        if time.monotonic() - t0 > 300:
            raise RuntimeError("server not healthy after 300 s")
        time.sleep(0.25)
    out(f"server ready after {time.monotonic() - t0:.2f} s (pid {p.pid})")
    # which code it runs: the step clock (ketch_engine_steps) is in /metrics from a194cc2 on
    has_clock = "ketch_engine_steps_total" in http_get("/metrics")[1]
    cwd = os.readlink(f"/proc/{p.pid}/cwd")
    env_pp = [v for v in open(f"/proc/{p.pid}/environ", "rb").read().split(b"\0") if v.startswith(b"PYTHONPATH=")]
    out(f"server code check: cwd {cwd}, {env_pp[0].decode() if env_pp else 'no PYTHONPATH'}, "
        f"/metrics has ketch_engine_steps_total: {'yes' if has_clock else 'no'}")
    return p


def stop_server(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    t0 = time.monotonic()
    while session_pids(p.pid) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    for pid in session_pids(p.pid):  # an engine process left behind: end it by its id
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def bench(side: str, c: int, label: str, pass_name: str) -> None:
    n = N_PROMPTS[c]
    out(f"\n################ run {label}: server={side} ({COMMIT[side][:7]}) concurrency={c} num_prompts={n} ({pass_name})")
    global waited_total
    while True:  # the slot waits for a quiet machine; it is never measured under load
        quiet, ok = wait_quiet()
        out(quiet)
        waited_total += float(quiet.split()[1])
        if ok:
            break
        if waited_total >= MAX_WAIT_TOTAL_S:
            raise SessionOver(f"the machine stayed busy: {waited_total:.0f} s of waiting in all (MAX_WAIT_TOTAL_S)")
        out(f"slot not measured at {now()} (machine busy for {QUIET_WAIT_S:.0f} s); the same slot waits again")
    out(f"date: {now()}")
    server = start_server(side, label)
    try:
        jpath = os.path.join(WORK, f"bench-{label}.json")
        cmd = [PY, "-m", "ketch.cli", "bench", "serve", "--base-url", URL, "--dataset-name", "random",
               "--random-input-len", "256", "--random-output-len", "128", "--random-range-ratio", "1",
               "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(c), "--seed", "0",
               "--disable-tqdm", "--output-file", jpath]
        out(f"bench command: cd {WT['after']} && PYTHONPATH={WT['after']} {' '.join(cmd)}")
        out(f"uptime before: {sh('uptime')}")
        b0, s0, t0, d0, st0 = machine_busy(), session_cpu(server.pid), time.monotonic(), sum(os.times()[:2]), steal()
        client = subprocess.Popen(cmd, cwd=WT["after"], env=E | {"PYTHONPATH": WT["after"]},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(client.stdout.read()), daemon=True)
        reader.start()
        aborted = status = ru = None
        while True:  # watch the others' share while the client runs; stop a run that is lost anyway
            time.sleep(2)
            pid, st, r = os.wait4(client.pid, os.WNOHANG)
            if pid:
                status, ru = st, r
                break
            el = time.monotonic() - t0
            oth = (machine_busy() - b0 - (session_cpu(server.pid) - s0) - session_cpu(client.pid)
                   - (sum(os.times()[:2]) - d0))
            if el >= ABORT_AFTER_S and 100 * oth / (el * NCPU) > ABORT_OTHERS:
                aborted = f"aborted after {el:.0f} s: others {100 * oth / (el * NCPU):.0f} % > {ABORT_OTHERS:.0f} % so far"
                os.killpg(client.pid, signal.SIGKILL)
        if status is None:
            _, status, ru = os.wait4(client.pid, 0)
        reader.join(10)
        text = b"".join(chunks).decode(errors="replace")
        client.returncode = rc = os.waitstatus_to_exitcode(status)
        b1, s1, t1, d1, st1 = machine_busy(), session_cpu(server.pid), time.monotonic(), sum(os.times()[:2]), steal()
        for line in text.rstrip().splitlines():
            out(line)
        out(f"bench rc: {rc}" + (f" ({aborted})" if aborted else ""))
        out(f"uptime after: {sh('uptime')}")
    finally:
        stop_server(server)
    wall = t1 - t0
    busy, srv, cli, drv = b1 - b0, s1 - s0, ru.ru_utime + ru.ru_stime, d1 - d0
    others = max(0.0, busy - srv - cli - drv)
    share = 100 * others / (wall * NCPU)
    out(f"CPU during the run ({wall:.0f} s wall, {NCPU} vCPUs = {wall * NCPU:.0f} CPU-s): machine busy {busy:.1f} CPU-s "
        f"({100 * busy / (wall * NCPU):.0f} %), this server {srv:.1f} + client {cli:.1f} + this driver {drv:.1f} CPU-s, "
        f"other processes ~{others:.1f} CPU-s ({share:.1f} % of the machine); steal {st1 - st0:.1f} CPU-s")
    m = json.load(open(jpath))["metrics"] if os.path.exists(jpath) else {}
    reasons = [aborted] if aborted else []
    if share > OTHERS_MAX:
        reasons.append(f"others {share:.0f} % > {OTHERS_MAX:.0f} %")
    if rc != 0 or not m:
        reasons.append(f"client rc {rc}")
    if m and m.get("failed", 0):
        reasons.append(f"{m['failed']} failed requests")
    runs.append({"label": label, "side": side, "c": c, "pass": pass_name,
                 "out": m.get("output_throughput"), "tpot": m.get("median_tpot_ms"), "ttft": m.get("mean_ttft_ms"),
                 "ok": f"{m.get('completed', 0)}/{n}", "others": share, "keep": not reasons, "taken": True,
                 "why": "; ".join(reasons)})
    out(f"verdict: {'kept' if runs[-1]['keep'] else 'SET ASIDE: ' + runs[-1]['why']}")


def abba(c: int, pass_name: str, tag: str) -> None:
    for i, side in enumerate(["before", "after", "after", "before"]):
        bench(side, c, f"{tag}_c{c}_{i + 1}{side[0].upper()}", pass_name)


def summary() -> list[str]:
    lines = ["SUMMARY (every run, in the order taken; others = other processes' share of the machine during the client window)",
             f"  {'label':<14} {'side':<6} {'C':>2} {'ok':>6} {'out tok/s':>9} {'med TPOT ms':>11} {'mean TTFT ms':>12} {'others':>7}  verdict"]
    for r in runs:
        if not r["taken"]:
            lines.append(f"  {r['label']:<14} {r['side']:<6} {r['c']:>2} {'-':>6} {'-':>9} {'-':>11} {'-':>12} {'-':>7}  SKIPPED: {r['why']}")
            continue
        lines.append(f"  {r['label']:<14} {r['side']:<6} {r['c']:>2} {r['ok']:>6} {r['out'] or 0:>9.2f} {r['tpot'] or 0:>11.2f} "
                     f"{r['ttft'] or 0:>12.1f} {r['others']:>6.1f}%  {'kept' if r['keep'] else 'SET ASIDE: ' + r['why']}")
    lines += ["", "MEDIANS over kept runs (output tok/s; median TPOT ms), after/before ratio",
              f"  {'C':>2}  {'before tok/s':>12} {'after tok/s':>11} {'ratio':>6}   {'before TPOT':>11} {'after TPOT':>10} {'ratio':>6}   kept/measured (before · after)"]
    for c in CONC:
        med = {}
        for side in ("before", "after"):
            kept = [r for r in runs if r["c"] == c and r["side"] == side and r["keep"]]
            med[side] = (statistics.median(r["out"] for r in kept) if kept else float("nan"),
                         statistics.median(r["tpot"] for r in kept) if kept else float("nan"), len(kept),
                         sum(1 for r in runs if r["c"] == c and r["side"] == side and r["taken"]))
        (bo, bt, bk, bn), (ao, at, ak, an) = med["before"], med["after"]
        lines.append(f"  {c:>2}  {bo:>12.2f} {ao:>11.2f} {ao / bo:>6.3f}   {bt:>11.2f} {at:>10.2f} {at / bt:>6.3f}   {bk}/{bn} · {ak}/{an}")
    return lines


# ---------------------------------------------------------------- greedy identity
COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Le café de la gare est très",
    "東京は日本の首都で、",
]
CHATS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 10.",
    "Explain in one sentence what a hash table is.",
    "Reply with a few emoji that describe the ocean 🌊.",
    "Translate 'good morning' into Spanish, German and Japanese.",
]
STOPS = [("completion", "The history of the Roman Empire began"), ("chat", "Tell me about the Moon in two sentences.")]


def identity_requests():
    for p in COMPLETIONS:
        yield "completion", p, None
    for p in CHATS:
        yield "chat", p, None
    for kind, p in STOPS:
        yield kind, p, ["."]


def identity_run(side: str) -> list[dict]:
    from openai import OpenAI
    out(f"\n################ identity: server={side} ({COMMIT[side][:7]})", identity_lines)
    out(f"date: {now()}", identity_lines)
    server = start_server(side, f"identity_{side}")
    results = []
    try:
        client = OpenAI(base_url=URL + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        for kind, prompt, stop in identity_requests():
            text, finish, usage = [], None, None
            extra = {"stop": stop} if stop else {}
            if kind == "completion":
                stream = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}, **extra)
                for ch in stream:
                    for choice in ch.choices:
                        text.append(choice.text or "")
                        finish = choice.finish_reason or finish
                    usage = ch.usage.completion_tokens if ch.usage else usage
            else:
                stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=48, temperature=0, stream=True,
                                                        stream_options={"include_usage": True}, **extra)
                for ch in stream:
                    for choice in ch.choices:
                        text.append(choice.delta.content or "")
                        finish = choice.finish_reason or finish
                    usage = ch.usage.completion_tokens if ch.usage else usage
            results.append({"kind": kind, "prompt": prompt, "stop": stop, "text": "".join(text), "finish": finish,
                            "completion_tokens": usage, "chunks": len(text)})
    finally:
        stop_server(server)
    json.dump(results, open(os.path.join(WORK, f"identity-{side}.json"), "w"), indent=1, ensure_ascii=False)
    return results


def identity() -> None:
    res = {side: identity_run(side) for side in ("before", "after")}
    out("\nGREEDY IDENTITY (14 streaming requests, temperature 0, max_tokens 48, sequential; "
        "text = the streamed pieces joined; compared as UTF-8 bytes)", identity_lines)
    same = 0
    for i, (b, a) in enumerate(zip(res["before"], res["after"], strict=True)):
        eq = (b["text"].encode() == a["text"].encode() and b["finish"] == a["finish"]
              and b["completion_tokens"] == a["completion_tokens"])
        same += eq
        out(f"  [{i + 1:>2}] {b['kind']:<10} stop={b['stop']!s:<6} finish {b['finish']}/{a['finish']} "
            f"tokens {b['completion_tokens']}/{a['completion_tokens']} chunks {b['chunks']}/{a['chunks']} "
            f"{'IDENTICAL' if eq else 'DIFFERENT'}  prompt={b['prompt']!r}", identity_lines)
        out(f"       text={b['text']!r}", identity_lines)
        if not eq:
            out(f"       AFTER text={a['text']!r}", identity_lines)
    out(f"identity: {same}/{len(res['before'])} requests byte-identical (text, finish_reason, usage.completion_tokens)",
        identity_lines)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the server, write the log
    model_name = sh("lscpu | grep -E '^Model name'")
    family = sh("lscpu | grep -E '^CPU family|^Model:' | tr -s ' ' | paste -sd';'")
    flags = sh("lscpu | grep -E '^Flags' | tr -s ' '")
    torch_v = sh(PY + " -c 'import torch; print(torch.__version__)'")
    header.append(f"date: {now()} (UTC; each run below has its own start time)")
    header.append(f"machine: {model_name}; {family}; {NCPU} vCPUs")
    header.append(f"lscpu {flags}")
    header.append(f"kernel: {sh('uname -r')}")
    header.append(f"python: {sh(PY + ' --version')}, torch {torch_v}")
    for side in ("before", "after"):
        wt = WT[side]
        subj = sh(f"git -C {wt} log -1 --format='%h %ci %s' HEAD")
        changed = sh(f"git -C {wt} status --short | wc -l")
        where = sh(f"cd {wt} && PYTHONPATH={wt} {PY} -c 'import ketch; print(ketch.__file__)'")
        header.append(f"{side.upper()}: {COMMIT[side]}  ({subj[:160]})")
        header.append(f"  worktree {wt} ({changed} changed files); ketch imported from: {where}")
    header.append(f"set-aside rule (fixed before the runs): others > {OTHERS_MAX:.0f} % of the machine during the client window, "
                  "a failed request, or client rc != 0; medians over kept runs")
    for line in header:
        print(line, flush=True)
    try:
        for p in range(1, PASSES + 1):
            for c in CONC:
                abba(c, f"pass {p}", f"p{p}")
        for k in range(1, MAKEUP_ROUNDS + 1):  # make-up ABBA where a side kept fewer than MIN_KEPT runs
            for c in CONC:
                short = [s for s in ("before", "after") if sum(1 for r in runs if r["c"] == c and r["side"] == s and r["keep"]) < MIN_KEPT]
                if short:
                    out(f"\n(make-up ABBA {k} at c={c}: fewer than {MIN_KEPT} kept runs for {', '.join(short)})")
                    abba(c, f"make-up {k}", f"mk{k}")
        if E.get("IDENTITY", "1") == "1":
            identity()
    except SessionOver as e:
        out(f"\nSESSION ENDED EARLY: {e}")
        identity_lines.append(f"SESSION ENDED EARLY: {e}")
    finally:
        text = ["ketch serve before/after on the CPU: raw log (scripts/cpu_before_after.sh)", "=" * 72, *header, "",
                "server: one at a time on 127.0.0.1, fresh for each run, its own worktree's code (PYTHONPATH), CPU defaults",
                "client: the AFTER tree's ketch bench serve for every run (1 warmup request not counted)", "",
                *summary(), *identity_lines, "", "RUNS", *body]
        with open(LOG, "w") as f:
            f.write("\n".join(text) + "\n")
        print(f"\nlog written: {LOG}", flush=True)
    return 0


sys.exit(main())
PYEOF

"$PY" "$WORK/driver.py" &
DRIVER=$!
rc=0
wait "$DRIVER" || rc=$?
DRIVER=
exit $rc
