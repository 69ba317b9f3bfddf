"""NVML's MIG profiles and placements of GPU 0, as JSON: what xpu_core::mig's tables must match.
NVML lists profiles and their possible placements whatever the GPU's MIG mode; nothing here
changes the GPU."""
import ctypes
import json
import pynvml as N

N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
name = N.nvmlDeviceGetName(h)
out = {"name": name.decode() if isinstance(name, bytes) else name,
       "driver": str(N.nvmlSystemGetDriverVersion()), "profiles": []}
try:
    out["mig_mode"] = list(N.nvmlDeviceGetMigMode(h))
except N.NVMLError as e:
    out["mig_mode"] = str(e)


def placements(pid):
    fn = N._nvmlGetFunctionPointer("nvmlDeviceGetGpuInstancePossiblePlacements_v2")
    count = ctypes.c_uint(0)
    fn(h, ctypes.c_uint(pid), None, ctypes.byref(count))
    arr = (N.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    r = fn(h, ctypes.c_uint(pid), arr, ctypes.byref(count))
    if r != 0:
        return {"error": r}
    return [[arr[i].start, arr[i].size] for i in range(count.value)]


for p in range(0, 16):
    d = {"index": p}
    try:
        try:
            info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, p, 2)
        except TypeError:
            info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, p)
    except N.NVMLError as e:
        d["error"] = str(e)
        out["profiles"].append(d)
        continue
    for f, _ in info._fields_:
        v = getattr(info, f)
        if isinstance(v, bytes):
            v = v.decode(errors="replace")
        if isinstance(v, (int, str)):
            d[f] = v
    try:
        d["placements"] = placements(info.id)
    except Exception as e:  # noqa: BLE001
        d["placements"] = {"error": repr(e)}
    out["profiles"].append(d)
print(json.dumps(out, indent=1))
