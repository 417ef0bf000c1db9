"""Per-request cost of serve() + its SSE response with a stand-in engine (1 prompt, 32 outputs)."""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
from types import SimpleNamespace
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import StreamingResponse
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from service.admission import Admission
from service.engine_client import ObservedEngineClient, report_acceptance
from service.metrics import ServiceMetrics
from service.request_flow import serve
from tests.test_stream_start import SCOPE

class Engine:
    errored = False
    async def add_request(self, request_id, prompt, params, **_):
        return request_id
    async def generate(self, prompt, params, request_id, **_):
        await self.add_request(request_id, prompt, params)
        for i in range(32):
            await asyncio.sleep(0)
            out = CompletionOutput(index=0, text="t", token_ids=[10], cumulative_logprob=None, logprobs=None,
                                   finish_reason="length" if i == 31 else None)
            yield RequestOutput(request_id, None, [1, 2, 3], None, [out], i == 31)

engine = Engine(); report_acceptance(engine)
handle = SimpleNamespace(engine=engine, active=set(), note_engine_failure=lambda e: False)
client = ObservedEngineClient(handle)
metrics = ServiceMetrics(CollectorRegistry(), "m", reexport_default_registry=False)
state = SimpleNamespace(metrics=metrics, warmup_metrics=metrics, admission=Admission(64, 64, None),
                        settings=SimpleNamespace(request_timeout_s=600.0))

def events(stream):
    async def gen():
        async for out in stream:
            yield f"data: {json.dumps({'text': out.outputs[0].text})}\n\n"
        yield "data: [DONE]\n\n"
    return gen()

async def receive():
    await asyncio.Event().wait()

async def send(msg):
    pass

async def ours():
    async def call():
        return events(client.generate({"prompt_token_ids": [1]}, SamplingParams(output_kind=RequestOutputKind.DELTA), "r"))
    response = await serve(Request(SCOPE, receive), state, 1, call)
    await response(SCOPE, receive, send)

async def plain():
    stream = engine.generate({"prompt_token_ids": [1]}, SamplingParams(output_kind=RequestOutputKind.DELTA), "r")
    await StreamingResponse(events(stream), media_type="text/event-stream")(SCOPE, receive, send)

async def main():
    for f in (plain, ours, plain, ours):
        for _ in range(50): await f()
        n = 1000; t = time.process_time()
        for _ in range(n): await f()
        print(f"{f.__name__}: {(time.process_time() - t) / n * 1e6:.0f} us CPU per request")
asyncio.run(main())

