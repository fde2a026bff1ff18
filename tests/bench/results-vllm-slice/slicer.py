#!/usr/bin/env python3
"""Gives every thread whose name contains PATTERN a custom EEVDF slice of
SLICE_NS (0: the kernel default), rescanning /proc every 0.5 s for SECONDS.
Used beside a bench run (results-vllm-slice/, tests/bench/README.md).

    python3 slicer.py SLICE_NS PATTERN SECONDS

sched_setattr(2) on x86_64 (syscall 314), SCHED_OTHER with sched_runtime set:
Linux 6.12 or later takes it as the thread's slice; no privilege needed.
"""
import ctypes, glob, struct, sys, time

libc = ctypes.CDLL(None, use_errno=True)
ns = int(sys.argv[1]); pat = sys.argv[2]; until = time.time() + float(sys.argv[3])
done = set(); names = {}
while time.time() < until:
    for comm in glob.glob('/proc/[0-9]*/task/[0-9]*/comm'):
        try: name = open(comm).read().strip()
        except OSError: continue
        tid = int(comm.split('/')[4])
        if pat in name and tid not in done:
            attr = struct.pack("IIQiIQQQII", 56, 0, 0, 0, 0, ns, 0, 0, 0, 0)
            if libc.syscall(314, tid, ctypes.create_string_buffer(attr), 0) == 0:
                done.add(tid); names[name] = names.get(name, 0) + 1
    time.sleep(0.5)
print("set", ns, names, file=sys.stderr)
