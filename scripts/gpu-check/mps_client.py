"""One MPS client of scripts/gpu-check: what it was told, and what it got.

usage: mps_client.py [rogue-]rate START_AT SECONDS | [rogue-]mem | [rogue-]both START_AT SECONDS

rate: bf16 8192^3 matrix products from wall-clock START_AT for SECONDS (so clients started
apart run together), reported as TFLOP/s. mem: 1 GiB allocations until one fails, reported as
MiB held. One JSON line on stdout. rogue-: the process sets its own CUDA_MPS_* limits (all of
the GPU) before CUDA starts, which MPS reads in the client: what xpu cannot hold.
"""
import json
import os
import sys
import time

mode = sys.argv[1]
if mode.startswith("rogue-"):
    mode = mode.removeprefix("rogue-")
    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "100"
    os.environ.pop("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", None)
    rogue = True
else:
    rogue = False
import torch  # noqa: E402

dev = torch.device("cuda")
res = {
    "mode": ("rogue-" if rogue else "") + mode,
    "pid": os.getpid(),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "XPU_", "NVIDIA_"))},
}
torch.cuda.init()
props = torch.cuda.get_device_properties(0)
res["device"] = props.name
res["multiprocessors"] = props.multi_processor_count
if mode in ("rate", "both"):
    start_at, seconds = float(sys.argv[2]), float(sys.argv[3])
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize()
    res["late_s"] = round(max(0.0, time.time() - start_at), 3)
    while time.time() < start_at:
        time.sleep(0.001)
    n, t = 0, time.time()
    while time.time() - t < seconds:
        for _ in range(4):
            c = a @ b
        torch.cuda.synchronize()
        n += 4
    el = time.time() - t
    res.update(tflops=round(2 * 8192**3 * n / el / 1e12, 1), products=n, seconds=round(el, 2),
               started=round(t, 3))
    del a, b, c
    torch.cuda.empty_cache()
if mode in ("mem", "both"):
    held, mib = [], 0
    try:
        while mib < 200 * 1024:
            held.append(torch.empty(1 << 30, dtype=torch.uint8, device=dev))
            mib += 1024
    except (torch.OutOfMemoryError, RuntimeError) as e:
        res["refused"] = str(e).splitlines()[0][:240]
    res["allocated_mib"] = mib
    del held
print(json.dumps(res), flush=True)
