"""Lab probe (not product): one server, c=8 load, py-spy on the API process, CPU per token."""
import asyncio, json, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3] if len(sys.argv) > 3 else "/work/main")
from bench.serve_servers import Server, EngineFlags, CPU_KV_CACHE_BYTES
from bench.serve_load import LoadClient
from service.embedded_model import ensure_embedded_model
from service.engine import default_engine_env

variant, out = sys.argv[1], Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
if __name__ == "__main__":
    default_engine_env()
    model = ensure_embedded_model()
    flags = EngineFlags(None, 4096, 256, 1, None, CPU_KV_CACHE_BYTES)
    srv = Server(variant, out / "server.log", model, flags)
    try:
        srv.wait_ready(600, lambda m: None)
        async def go():
            cl = LoadClient(srv.base_url, "yardstick", 128, 32000, out / "req.jsonl")
            await cl.level(0, 8, 64, 0, 32)
            spy = subprocess.Popen(["/tmp/pyspy/bin/py-spy", "record", "--pid", str(srv.proc.proc.pid), "--duration", "45",
                                    "--format", "raw", "-o", str(out / "spy.txt"), "--rate", "250", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            c0 = srv.api_cpu_s(); t0 = time.time()
            recs = await cl.level(1, 8, 0, int(sys.argv[4]) if len(sys.argv) > 4 else 200, 32)
            c1 = srv.api_cpu_s(); t1 = time.time()
            spy.wait()
            toks = sum(r.output_tokens for r in recs)
            res = {"variant": variant, "cpu_s": c1 - c0, "wall_s": t1 - t0, "tokens": toks, "us_per_tok": (c1 - c0) * 1e6 / toks}
            print(json.dumps(res)); (out / "res.json").write_text(json.dumps(res))
            await cl.close()
        asyncio.run(go())
    finally:
        srv.stop()
