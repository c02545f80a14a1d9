"""The device's copy bandwidth, the denominator of the bs1 rooflines (docs/performance.md, issue 19):
a 1 GiB device-to-device copy, read + write bytes over its time, median of 20 in a loop."""
import statistics

import torch


def main() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {2 * src.numel() / ms / 1e6:,.0f} GB/s "
          f"(1 GiB device copy, read + write, median of 20)")


if __name__ == "__main__":
    main()
