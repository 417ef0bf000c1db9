import sys, time, runpy, atexit, os
import zmq.sugar.socket as zs
orig = zs.Socket.send_multipart
stats = []
def patched(self, msg_parts, *a, **k):
    t = time.perf_counter()
    r = orig(self, msg_parts, *a, **k)
    stats.append((time.perf_counter() - t, sum(len(memoryview(p)) if not isinstance(p, int) else 0 for p in msg_parts), len(msg_parts), k.get("copy", a[1] if len(a) > 1 else None)))
    if len(stats) % 200 == 0:
        s = sorted(stats[-200:])
        sys.stderr.write(f"[zmqstat] n={len(stats)} send p50 {s[100][0]*1e6:.0f} us p90 {s[180][0]*1e6:.0f} us bytes p50 {sorted(x[1] for x in stats[-200:])[100]} parts {s[100][2]} copy {s[100][3]}\n")
    return r
zs.Socket.send_multipart = patched
mod = sys.argv[1]; sys.argv = [mod] + sys.argv[2:]
runpy.run_module(mod, run_name="__main__", alter_sys=True)
